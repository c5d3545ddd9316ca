"""`make demo`: the whole SFT slice on SmolLM2-135M-Instruct, into the persistent Dagster/MLflow state.

Runs the `sft_chain` job (base model → chat dataset → rendered tokens → SFT checkpoints) and then the
`sft_eval` job for each checkpoint partition that run produced, on the DAGSTER_HOME that `make ui`
serves, so every run, asset, check and MLflow entry is there to browse afterwards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import dagster as dg

from assets.checkpoint_manifest import CheckpointManifest, all_manifests
from resources.state import ensure_dagster_home, state_dir

QUIET = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}  # no DEBUG event lines on the terminal
# Two-number addition ("Calculate 43 + 12."): the base 135M model gets few right, and a few minutes of
# LoRA SFT on 2 CPU cores measurably fixes both its format and its sums on held-out problems.
DEMO_SOURCE = (
    "reasoning_gym:basic_arithmetic?min_terms=2&max_terms=2&min_digits=1&max_digits=2&operators=+"
    "&allow_parentheses=false&allow_negation=false"
)
DEMO_DATA = {"source": DEMO_SOURCE, "limit": 600, "heldout_fraction": 0.1}
# Sized for "a few minutes on 2 CPU cores" with SmolLM2-135M: 40 steps of 8 conversations, two checkpoints.
DEMO_TRAINING = {"learning_rate": 1e-3, "batch_size": 8, "max_steps": 40, "save_every": 20, "lora_rank": 16}


@dataclass
class DemoResult:
    chain_run_id: str
    eval_run_ids: dict[str, str]
    checkpoints: list[CheckpointManifest]
    reports: dict[str, dict[str, Any]]
    seconds: float


def run_demo(defs: dg.Definitions, training: dict[str, Any] | None = None, evaluate_all: bool = True) -> DemoResult:
    started = time.monotonic()
    home = ensure_dagster_home()
    with dg.DagsterInstance.from_config(str(home)) as instance:
        chain = defs.resolve_job_def("sft_chain").execute_in_process(
            instance=instance,
            run_config={
                **QUIET,
                "ops": {
                    "chat_dataset": {"config": DEMO_DATA},
                    "sft_checkpoint": {"config": {**DEMO_TRAINING, **(training or {})}},
                },
            },
        )
        checkpoints = [m for m in all_manifests() if m.training_dagster_run_id == chain.run_id]
        checkpoints.sort(key=lambda m: m.step)
        chosen = checkpoints if evaluate_all else checkpoints[-1:]
        eval_job = defs.resolve_job_def("sft_eval")
        eval_runs, reports = {}, {}
        for manifest in chosen:
            result = eval_job.execute_in_process(instance=instance, partition_key=manifest.partition, run_config=QUIET)
            eval_runs[manifest.partition] = result.run_id
            (materialization,) = result.asset_materializations_for_node("sft_eval_report")
            reports[manifest.partition] = {k: getattr(v, "value", v) for k, v in materialization.metadata.items()}
    return DemoResult(chain.run_id, eval_runs, checkpoints, reports, time.monotonic() - started)


def format_demo(result: DemoResult) -> str:
    lines = [f"SFT demo finished in {result.seconds:.0f} s. State: {state_dir()}", ""]
    lines.append(f"training run (Dagster): {result.chain_run_id}")
    if result.checkpoints:
        lines.append(f"training run (MLflow):  {result.checkpoints[-1].mlflow_run_url}")
    lines.append("")
    lines.append("checkpoint                    step   nll (base→ckpt)     bpb (base→ckpt)     accuracy (base→ckpt)")
    for manifest in result.checkpoints:
        report = result.reports.get(manifest.partition)
        if report is None:
            lines.append(f"{manifest.partition:<29} {manifest.step:>4}   (not evaluated)")
            continue
        cells = [f"{report[f'base_{n}']:.3f} → {report[f'checkpoint_{n}']:.3f}" for n in ("nll", "bpb", "accuracy")]
        lines.append(f"{manifest.partition:<29} {manifest.step:>4}   {cells[0]:<19} {cells[1]:<19} {cells[2]}")
    if result.checkpoints:
        final = result.checkpoints[-1]
        lines += [
            "",
            f"final checkpoint: {final.state_path}",
            f"MLflow model:     {final.registered_model} v{final.model_version}",
            "",
            "Where to look:",
            "  make ui                 Dagster UI http://127.0.0.1:3000 (assets, runs, checks), MLflow UI http://127.0.0.1:5000",
            f"  .venv/bin/python -m pipelines lineage {final.registered_model}/{final.model_version}",
        ]
    return "\n".join(lines)
