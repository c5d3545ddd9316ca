"""The RLHF demo's stages one at a time, for tuning their defaults without re-running the stages before.

    # once: the RLHF demo's SFT stage into a state directory of their own
    POSTTRAIN_STATE_DIR=/tmp/rlhf-tuning .venv/bin/python bench/demo_rlhf_stage.py sft
    # then, as often as needed: the preference-model stage (comparisons + training + eval) from the newest SFT
    POSTTRAIN_STATE_DIR=/tmp/rlhf-tuning .venv/bin/python bench/demo_rlhf_stage.py preference_model \
        preference_model_checkpoint.learning_rate=5e-4 onpolicy_comparisons.limit=600
    # and the RLHF stage from the newest SFT checkpoint against the newest preference model
    POSTTRAIN_STATE_DIR=/tmp/rlhf-tuning .venv/bin/python bench/demo_rlhf_stage.py rlhf rlhf_checkpoint.learning_rate=1e-4

Overrides are ``<op>.<field>=<JSON value>`` on ``pipelines/demo.py``'s stage configs; ``eval.<field>=...``
overrides the stage's eval-report config. Prints the stage's eval table (final checkpoint: base, parent,
checkpoint, Δ vs the parent ± its paired standard error) and the stage's wall time, as the demo prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
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
    parser.add_argument("stage", choices=("sft", "preference_model", "rlhf"))
    parser.add_argument("overrides", nargs="*", help="<op>.<field>=<JSON value> (eval.<field> for the eval report)")
    parser.add_argument("--all", action="store_true", help="evaluate every checkpoint, not only the last")
    parser.add_argument("--no-eval", action="store_true", help="train only (e.g. judge the preference model with bench/rlhf_judge_errors.py)")
    parser.add_argument("--train-only", action="store_true", help="the <recipe>_train job: train on the newest data already there, no eval")
    args = parser.parse_intermixed_args()
    if "POSTTRAIN_STATE_DIR" not in os.environ:
        parser.error("set POSTTRAIN_STATE_DIR to a directory of its own (the prepared checkpoints live there)")

    import dagster as dg

    from pipelines.definitions import defs
    from pipelines.demo import QUIET, STAGE_SETS, format_stage, run_stage
    from resources.state import ensure_dagster_home

    stage = next(s for s in STAGE_SETS["rlhf"] if s.recipe == args.stage)
    overrides: dict[str, dict] = {}
    for item in args.overrides:
        key, value = item.split("=", 1)
        op, field = key.split(".", 1)
        overrides.setdefault(op, {})[field] = _value(value)
    if "eval" in overrides:
        stage = replace(stage, eval_config={**stage.eval_config, **overrides.pop("eval")})
    home = ensure_dagster_home()
    started = time.monotonic()
    with dg.DagsterInstance.from_config(str(home)) as instance:
        if args.no_eval or args.train_only:
            ops = {name: {"config": {**op["config"], **overrides.get(name, {})}} for name, op in stage.run_config.items()}
            if args.train_only:
                ops = {name: op for name, op in ops.items() if name == f"{stage.recipe}_checkpoint"}
            job = f"{stage.recipe}_train" if args.train_only else stage.chain_job
            run = defs.resolve_job_def(job).execute_in_process(instance=instance, run_config={**QUIET, "ops": ops})
            print(f"== {stage.recipe}: run {run.run_id} success={run.success}", flush=True)
        else:
            print(format_stage(run_stage(defs, instance, stage, overrides, evaluate_all=args.all)), flush=True)
    print(f"   overrides: {overrides}; eval: {stage.eval_config}; {time.monotonic() - started:.0f} s; load {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
