"""One stage of `make demo` (or of `demo --stages rlhf`) at a time, for tuning its defaults without re-running the
stages before it. Not a speed bench: it prints the stage's eval table, as the demo does.

    export POSTTRAIN_STATE_DIR=/tmp/tuning          # a state directory of its own
    .venv/bin/python scripts/demo_stage.py sft      # once; then dpo once, before tuning rl
    .venv/bin/python scripts/demo_stage.py dpo
    .venv/bin/python scripts/demo_stage.py rl rl_checkpoint.learning_rate=1e-4 rl_checkpoint.groups_per_batch=16
    .venv/bin/python scripts/demo_stage.py preference_model preference_model_checkpoint.learning_rate=5e-4
    .venv/bin/python scripts/demo_stage.py rlhf rlhf_checkpoint.kl_penalty_coef=0.05 eval.max_problems=64
    .venv/bin/python scripts/demo_stage.py rlhf --evaluate <partition> [<partition> …]   # (re-)score checkpoints only

A stage chains from the newest checkpoint of the stage before it in ``pipelines/demo.py`` (``stage:<name>`` in its
config: the newest checkpoint that stage trained in this state, e.g. ``sft_parent``, the RLHF set's weak SFT). Overrides are
``<op>.<field>=<JSON value>`` on the stage's chain config (``eval.<field>`` on its eval-report config). Prints the
stage's eval table (final checkpoint: base, parent, checkpoint, Δ vs the parent ± its paired standard error),
the overrides, the wall time and the load average (trials on a shared machine are slower by that much).
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


def parse_overrides(items: list[str]) -> dict[str, dict]:
    """``op.field=value`` items as ``{op: {field: value}}``, each value read as JSON when it parses as JSON."""
    overrides: dict[str, dict] = {}
    for item in items:
        key, sep, text = item.partition("=")
        op, dot, field = key.partition(".")
        if not sep or not dot:
            raise SystemExit(f"error: override {item!r}: write <op>.<field>=<value>, e.g. rl_checkpoint.learning_rate=1e-4")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        overrides.setdefault(op, {})[field] = value
    return overrides


def main() -> int:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(name, "1")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from pipelines.demo import STAGE_SETS

    stages = {stage.label: stage for stage_set in STAGE_SETS.values() for stage in stage_set}
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=sorted(stages))
    parser.add_argument("overrides", nargs="*", help="<op>.<field>=<JSON value> (eval.<field> for the eval report)")
    parser.add_argument("--all", action="store_true", help="evaluate every checkpoint, not only the last")
    parser.add_argument("--no-eval", action="store_true", help="run the chain only (e.g. then judge with scripts/rlhf_judge_errors.py)")
    parser.add_argument("--train-only", action="store_true", help="the <recipe>_train job: train on the newest data already there, no eval")
    parser.add_argument("--evaluate", nargs="+", metavar="PARTITION", help="no training: run the eval report of these checkpoints")
    args = parser.parse_intermixed_args()
    if "POSTTRAIN_STATE_DIR" not in os.environ:
        parser.error("set POSTTRAIN_STATE_DIR to a directory of its own (the prepared checkpoints live there)")

    import dagster as dg

    from pipelines.definitions import defs
    from assets.checkpoint_manifest import read_manifest
    from pipelines.demo import DEMO_STAGE_TAG, QUIET, StageResult, evaluate_checkpoint, format_stage, run_stage, stage_ops
    from resources.state import ensure_dagster_home

    stage = stages[args.stage]
    overrides = parse_overrides(args.overrides)
    if "eval" in overrides:
        stage = replace(stage, eval_config={**stage.eval_config, **overrides.pop("eval")})
    started = time.monotonic()
    with dg.DagsterInstance.from_config(str(ensure_dagster_home())) as instance:
        if args.evaluate:
            result = StageResult(stage, "(none: --evaluate)", [read_manifest(partition) for partition in args.evaluate])
            for partition in args.evaluate:
                result.reports[partition] = evaluate_checkpoint(defs, instance, stage, partition)
            result.seconds = time.monotonic() - started
            print(format_stage(result), flush=True)
        elif args.no_eval or args.train_only:
            ops = stage_ops(instance, stage, overrides)
            if args.train_only:
                ops = {name: op for name, op in ops.items() if name == f"{stage.recipe}_checkpoint"}
            job = f"{stage.recipe}_train" if args.train_only else stage.chain_job
            run = defs.resolve_job_def(job).execute_in_process(
                instance=instance, run_config={**QUIET, "ops": ops}, tags={DEMO_STAGE_TAG: stage.label}
            )
            print(f"== {stage.label}: run {run.run_id} success={run.success}", flush=True)
        else:
            print(format_stage(run_stage(defs, instance, stage, overrides, evaluate_all=args.all)), flush=True)
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print(f"   overrides: {overrides}; eval: {stage.eval_config}; {time.monotonic() - started:.0f} s; load {load}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
