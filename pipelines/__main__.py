"""Command line: `python -m pipelines demo | ui | lineage <checkpoint> [--json] | benchmark <checkpoint> --task <name> | export <checkpoint> --out DIR`."""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    parser = argparse.ArgumentParser(prog="python -m pipelines", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the recipe chain (SFT → DPO → RL, or --stages rlhf), every eval report, then the leaderboard")
    demo.add_argument("--max-steps", type=int, default=0, help="training steps of every stage (default: each stage's, in pipelines/demo.py)")
    demo.add_argument("--final-only", action="store_true", help="evaluate only the final checkpoint")
    demo.add_argument("--stages", choices=("default", "rlhf"), default="default",
                      help="default: SFT → DPO → RL; rlhf: SFT, a weak SFT parent → preference model → RLHF (about an hour on 2 cores)")
    ui = commands.add_parser("ui", help="serve the Dagster UI (:3000) and the MLflow UI (:5000) on loopback")
    ui.add_argument("--dagster-port", type=int, default=3000)
    ui.add_argument("--mlflow-port", type=int, default=5000)
    lineage = commands.add_parser("lineage", help="trace a checkpoint to its run, data and base model")
    lineage.add_argument("reference", nargs="?", help="tinker:// path, <registered-model>/<version> or partition key")
    lineage.add_argument("--list", action="store_true", help="list known checkpoints")
    lineage.add_argument("--json", action="store_true", help="print the hops as JSON (datasets with version, source, revision, rows)")
    bench = commands.add_parser("benchmark", help="benchmark a checkpoint or base model through inspect-ai (one JSON line per task)")
    bench.add_argument("reference", nargs="?", help="checkpoint (as lineage takes it) or a base model name")
    bench.add_argument("--task", action="append", default=[], help="gsm8k | math500 | mmlu | ifeval | humaneval | inspect_evals/<task> | file.py[@task]; repeatable")
    bench.add_argument("--limit", type=int, default=0, help="samples per task (default: all)")
    bench.add_argument("--max-tokens", type=int, default=0, help="answer budget (default: the task's)")
    bench.add_argument("-T", dest="task_args", action="append", default=[], metavar="NAME=VALUE", help="task argument (value read as JSON when it parses)")
    bench.add_argument("--leaderboard", action="store_true", help="then refresh and print the leaderboard")
    export = commands.add_parser("export", help="export a checkpoint as a PEFT adapter (and a merged HF model), verified against the server")
    export.add_argument("reference", help="tinker://…/weights/… path, <registered-model>/<version> or partition key")
    export.add_argument("--out", required=True, help="directory to create (must not exist)")
    export.add_argument("--merged", action="store_true", help="also write the merged model (loads with AutoModelForCausalLM alone)")
    export.add_argument("--gguf", action="store_true", help="also write gguf/model.gguf (float32; implies --merged)")
    args = parser.parse_args(argv)

    from resources.state import ensure_dagster_home

    ensure_dagster_home()
    if args.command == "ui":
        from pipelines.ui import serve

        return serve(args.dagster_port, args.mlflow_port)
    if args.command == "export":
        from pipelines.export import run_cli as run_export

        return run_export(args.reference, args.out, args.merged, args.gguf)
    if args.command == "benchmark":
        from pipelines.benchmarks import parse_task_args, run_cli

        return run_cli(args.reference, args.task, args.limit, args.max_tokens, parse_task_args(args.task_args), args.leaderboard)
    if args.command == "demo":
        # Its output is progress lines and result tables; transformers' per-load "Loading weights" bar is neither.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        # The demo's data is generated: it runs offline. Everything else follows the environment, so a hub
        # dataset named in a run config downloads when a network is present.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        from pipelines.definitions import defs
        from pipelines.demo import STAGE_SETS, format_demo, run_demo

        stages = STAGE_SETS[args.stages]
        overrides = {f"{stage.recipe}_checkpoint": {"max_steps": args.max_steps} for stage in stages} if args.max_steps else {}
        print(format_demo(run_demo(defs, overrides, evaluate_all=not args.final_only, stages=stages)))
        return 0
    return _lineage(args)


def _lineage(args: argparse.Namespace) -> int:
    import dagster as dg

    from assets.checkpoint_manifest import all_manifests
    from pipelines.lineage import format_lineage, lineage_json, trace
    from resources.mlflow import MlflowResource

    if args.list or not args.reference:
        for manifest in all_manifests():
            print(f"{manifest.partition}  {manifest.registered_model}/{manifest.model_version}  {manifest.state_path}")
        return 0
    with dg.DagsterInstance.get() as instance:
        try:
            lineage = trace(args.reference, instance, MlflowResource().get_client())
        except LookupError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        print(json.dumps(lineage_json(lineage), indent=2, default=str) if args.json else format_lineage(lineage))
    return 0


if __name__ == "__main__":
    sys.exit(main())
