"""The demo's RL stage alone, for tuning its defaults without re-running SFT and DPO each time.

    # once: the demo's SFT and DPO stages into a state directory of their own
    POSTTRAIN_STATE_DIR=/tmp/rl-tuning .venv/bin/python bench/demo_rl_stage.py --prepare
    # then, as often as needed: the RL stage from that DPO checkpoint, with overrides of pipelines/demo.py's DEMO_RL
    POSTTRAIN_STATE_DIR=/tmp/rl-tuning .venv/bin/python bench/demo_rl_stage.py learning_rate=1e-4 groups_per_batch=16

Prints the RL stage's eval table (final checkpoint: base, parent = the DPO checkpoint, checkpoint, Δ vs the parent
± its paired standard error) and the stage's wall time, as `make demo` would print it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare", action="store_true", help="run the demo's SFT and DPO stages (once per state dir)")
    parser.add_argument("--sft", action="append", default=[], metavar="KEY=VALUE", help="with --prepare: sft_checkpoint config overrides")
    parser.add_argument("overrides", nargs="*", help="rl_checkpoint config overrides, key=value (JSON values)")
    args = parser.parse_args()
    if "POSTTRAIN_STATE_DIR" not in os.environ:
        parser.error("set POSTTRAIN_STATE_DIR to a directory of its own (the prepared SFT and DPO checkpoints live there)")

    import dagster as dg

    from pipelines.definitions import defs
    from pipelines.demo import DPO_STAGE, RL_STAGE, SFT_STAGE, format_stage, run_stage
    from resources.state import ensure_dagster_home

    home = ensure_dagster_home()
    overrides = {"rl_checkpoint": dict(item.split("=", 1) for item in args.overrides)}
    overrides["rl_checkpoint"] = {key: _value(value) for key, value in overrides["rl_checkpoint"].items()}
    overrides["sft_checkpoint"] = {key: _value(value) for key, value in (item.split("=", 1) for item in args.sft)}
    with dg.DagsterInstance.from_config(str(home)) as instance:
        stages = (SFT_STAGE, DPO_STAGE) if args.prepare else (RL_STAGE,)
        for stage in stages:
            started = time.monotonic()
            result = run_stage(defs, instance, stage, overrides, evaluate_all=False)
            print(format_stage(result), flush=True)
            shown = overrides["rl_checkpoint"] if stage is RL_STAGE else overrides["sft_checkpoint"] if stage is SFT_STAGE else {}
            print(f"   overrides: {shown}; {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
