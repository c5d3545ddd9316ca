"""`make demo`: the recipe chain on SmolLM2-135M-Instruct, into the persistent Dagster/MLflow state.

Stage by stage (SFT → DPO on on-policy pairs → RL), each stage runs its recipe's ``<recipe>_chain`` job
(data → training, chained ``init_from`` the previous stage's newest checkpoint) and then its
``<recipe>_eval`` job for every checkpoint that run produced, on the DAGSTER_HOME that `make ui` serves,
so every run, asset, check and MLflow entry is there to browse afterwards. Each stage's eval reports
compare the checkpoint with the base model and with its parent (the previous stage's checkpoint).
Then the benchmark stage runs the ``benchmark`` job (the one the sensor launches) for the base model and
each stage's final checkpoint on two generated benchmarks, and materializes and prints the ``leaderboard``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import dagster as dg
import pyarrow.parquet as pq

from assets.benchmarks import BenchmarkKey, base_key, ensure_partitions
from assets.checkpoint_manifest import CheckpointManifest, all_manifests
from pipelines.benchmarks import BENCHMARK_JOB, refresh_leaderboard
from posttrain.benchmarks import leaderboard as board
from resources.mlflow_links import absolute_mlflow_url
from resources.state import ensure_dagster_home, state_dir, state_subdir
from resources.tinker import TinkerResource

QUIET = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}  # no DEBUG event lines on the terminal
# Two-number addition ("Calculate 43 + 12."): the base 135M model gets few right, and a few minutes of
# LoRA SFT on 2 CPU cores measurably fixes both its format and its sums on held-out problems.
DEMO_SOURCE = (
    "reasoning_gym:basic_arithmetic?min_terms=2&max_terms=2&min_digits=1&max_digits=2&operators=+"
    "&allow_parentheses=false&allow_negation=false"
)
# A tenth held out by prompt hash: enough held-out problems to tell a real change of a few points from noise
# (the reports' paired standard errors say how much), and enough to train on that no stage repeats its problems:
# RL that replays a small pool memorises its answers and loses held-out accuracy (docs/demo-rl-tuning.md).
DEMO_DATA = {"source": DEMO_SOURCE, "limit": 3000, "heldout_fraction": 0.1}
# Every report scores all held-out items (the EvalConfig defaults cap them for quick launches).
DEMO_EVAL = {"max_problems": 0, "max_heldout_sequences": 0, "max_tokens": 16, "pass_k": 4}
# Sized for "a few minutes on 2 CPU cores" with SmolLM2-135M: each training problem it reaches seen once, two
# checkpoints.
DEMO_TRAINING = {"learning_rate": 1e-3, "batch_size": 16, "max_steps": 92, "save_every": 46, "lora_rank": 16}


# A demo stage's chain run carries its stage name, so a later stage can name its checkpoint as `stage:<name>`
# (two stages of one recipe — a strong and a weak SFT — cannot be told apart by `latest:<recipe>`).
DEMO_STAGE_TAG = "posttrain/demo_stage"
STAGE_REFERENCE = "stage:"


@dataclass(frozen=True)
class DemoStage:
    recipe: str
    run_config: dict[str, Any]  # the ops config of `<recipe>_chain`; `stage:<name>` strings name an earlier stage's checkpoint
    eval_config: dict[str, Any] = field(default_factory=lambda: dict(DEMO_EVAL))  # `<recipe>_eval_report`'s config
    benchmarked: bool = True  # its final checkpoint joins the leaderboard (a preference model answers no questions)
    name: str = ""  # the stage's name where a set has two stages of one recipe; default: the recipe

    @property
    def label(self) -> str:
        return self.name or self.recipe

    @property
    def chain_job(self) -> str:
        return f"{self.recipe}_chain"


def stage_checkpoint(instance: dg.DagsterInstance, name: str) -> str:
    """The final checkpoint partition of the newest chain run of the demo stage ``name`` in this state."""
    manifests = all_manifests()
    for run in instance.get_runs(filters=dg.RunsFilter(tags={DEMO_STAGE_TAG: name})):  # newest first
        trained = [manifest for manifest in manifests if manifest.training_dagster_run_id == run.run_id]
        if trained:
            return max(trained, key=lambda manifest: manifest.step).partition
    raise LookupError(
        f"{STAGE_REFERENCE}{name} names the demo stage {name!r}, which has no checkpoint in this state: run that stage "
        f"first (scripts/demo_stage.py {name}) or override the field with a checkpoint partition key"
    )


def resolve_stage_references(config: Any, lookup: Callable[[str], str]) -> Any:
    """``config`` with every ``stage:<name>`` string replaced by ``lookup(name)`` (a checkpoint partition key)."""
    if isinstance(config, dict):
        return {key: resolve_stage_references(value, lookup) for key, value in config.items()}
    if isinstance(config, str) and config.startswith(STAGE_REFERENCE):
        return lookup(config.removeprefix(STAGE_REFERENCE))
    return config


SFT_STAGE = DemoStage(
    "sft", {"chat_dataset": {"config": DEMO_DATA}, "sft_checkpoint": {"config": DEMO_TRAINING}}
)
# DPO on on-policy pairs: the SFT checkpoint answers train+held-out problems 4 times at temperature 1;
# a prompt with a right and a wrong answer gives a pair (few do, at the SFT model's accuracy). The
# reference is the SFT checkpoint (the DPO run's start), scored once by reference_logprobs.
DEMO_ONPOLICY = {"sampler": "latest:sft", "group_size": 4, "max_tokens": 24, "temperature": 1.0, "limit": 400}
DEMO_DPO = {"beta": 0.1, "learning_rate": 2e-5, "batch_size": 8, "num_epochs": 1, "save_every": 5, "lora_rank": 16}
DPO_STAGE = DemoStage(
    "dpo",
    {
        "rl_problems": {"config": DEMO_DATA},
        "onpolicy_comparisons": {"config": DEMO_ONPOLICY},
        "reference_logprobs": {"config": {"pairs": "onpolicy_pairs", "reference": "latest:sft"}},
        "dpo_checkpoint": {"config": {**DEMO_DPO, "pairs": "onpolicy_pairs", "init_from": "latest:sft"}},
    },
)
# RL on the same task, from the DPO checkpoint: no problem repeated, rewarded by the task's own scorer,
# importance-sampling loss. Most groups are all-correct (no signal): enough problems per step make the gain hold
# across seeds, and a higher LR or replaying a small pool trades greedy accuracy for a sharper sampler
# (docs/demo-rl-tuning.md).
DEMO_RL = {
    "init_from": "latest:dpo",
    "env": "problems",
    "group_size": 8,
    "groups_per_batch": 32,
    "max_tokens": 16,
    "learning_rate": 1e-4,
    "lora_rank": 16,
    "max_steps": 40,
    "save_every": 20,
}
RL_STAGE = DemoStage("rl", {"rl_problems": {"config": DEMO_DATA}, "rl_checkpoint": {"config": DEMO_RL}})
STAGES: tuple[DemoStage, ...] = (SFT_STAGE, DPO_STAGE, RL_STAGE)
# RLHF (`python -m pipelines demo --stages rlhf`): the chain that reaches the issue's goals, in one command (docs/rlhf.md,
# eighth pass). RLHF refines a weak SFT checkpoint (12 steps), which leaves room to improve; a strong one (the
# demo's) is the judge's init and writes its reference answers. The verifier is never a reward, so held-out accuracy
# in the eval report is an honest check. Not in `make demo` (its 15-minute budget).
SFT_PARENT_STAGE = DemoStage(
    "sft",
    {"chat_dataset": {"config": DEMO_DATA}, "sft_checkpoint": {"config": {**DEMO_TRAINING, "max_steps": 12, "save_every": 0}}},
    name="sft_parent",
)
# The judge learns from the graded answers of the policy it will judge first (the weak parent's: a right and a wrong
# answer of one prompt, every problem x 4 at T = 1), in both orders; 200 steps (~1.1 epochs) at LR 5e-4: the label
# loss sits at ln 2 for ~40 steps before it falls. `reference: chosen`: it reads a reference answer before the pair
# (trained with the verified chosen one), so it compares answers instead of doing the sum inside its verdict
# (sixth pass). Trained on the strong SFT's own answers instead, it judged the hard held-out prompts 0.699.
DEMO_PM_COMPARISONS = {"sampler": "stage:sft_parent", "group_size": 4, "max_tokens": 16, "temperature": 1.0, "limit": 0}
DEMO_PM = {
    "init_from": "stage:sft", "learning_rate": 5e-4, "batch_size": 16, "num_epochs": 2, "max_steps": 200, "save_every": 0,
    "lora_rank": 16, "reference": "chosen",
}
PREFERENCE_MODEL_STAGE = DemoStage(
    "preference_model",
    {
        "rl_problems": {"config": DEMO_DATA},
        "onpolicy_comparisons": {"config": DEMO_PM_COMPARISONS},
        "preference_model_checkpoint": {"config": {**DEMO_PM, "comparisons": "onpolicy_comparisons"}},
    },
    benchmarked=False,  # a judge answers no benchmark questions
)
# 48 steps of 32 prompts x 8 samples at a constant LR 3e-4, tournaments in chunks of 4 judged in both orders, the
# strong SFT checkpoint writing the judge's references, KL 0.05 to the parent (smaller or decaying steps stopped at
# ~0.74 held-out accuracy and a win rate of 0.57–0.59: docs/rlhf.md, seventh pass).
DEMO_RLHF = {
    "init_from": "stage:sft_parent",
    "preference_model": "stage:preference_model",
    "judge_reference_from": "stage:sft",
    "env": "rl_problems",
    "group_size": 8,
    "groups_per_batch": 32,
    "tournament_chunk_size": 4,
    "max_tokens": 16,
    "learning_rate": 3e-4,
    "lr_schedule": "constant",
    "kl_penalty_coef": 0.05,
    "kl_reference": "parent",
    "lora_rank": 16,
    "max_steps": 48,
    "save_every": 48,
}
# Every held-out prompt: identical answers of policy and parent are ties that cost no judging.
RLHF_STAGE = DemoStage("rlhf", {"rl_problems": {"config": DEMO_DATA}, "rlhf_checkpoint": {"config": DEMO_RLHF}},
                       eval_config={**DEMO_EVAL, "max_problems": 0})
STAGE_SETS: dict[str, tuple[DemoStage, ...]] = {
    "default": STAGES, "rlhf": (SFT_STAGE, SFT_PARENT_STAGE, PREFERENCE_MODEL_STAGE, RLHF_STAGE),
}


@dataclass
class StageResult:
    stage: DemoStage
    chain_run_id: str
    checkpoints: list[CheckpointManifest]
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0


# The leaderboard: the base model and every stage's final checkpoint on GSM8K-format sums and their
# multiple-choice variant (generated, offline), 100 problems each — about as much sampling as one eval report.
DEMO_BENCHMARKS = ("arithmetic_gsm8k", "arithmetic_choice")
DEMO_BENCHMARK_LIMIT = 100


@dataclass
class BenchmarkStageResult:
    partitions: list[str]
    limit: int
    leaderboard: str  # the leaderboard as a terminal table
    chart: str
    seconds: float


@dataclass
class DemoResult:
    stages: list[StageResult]
    seconds: float
    benchmarks: BenchmarkStageResult | None = None


def run_stage(defs: dg.Definitions, instance: dg.DagsterInstance, stage: DemoStage, overrides: dict[str, Any], evaluate_all: bool) -> StageResult:
    started = time.monotonic()
    ops = stage_ops(instance, stage, overrides)
    chain = defs.resolve_job_def(stage.chain_job).execute_in_process(
        instance=instance, run_config={**QUIET, "ops": ops}, tags={DEMO_STAGE_TAG: stage.label}
    )
    checkpoints = sorted(
        (m for m in all_manifests() if m.training_dagster_run_id == chain.run_id and m.recipe == stage.recipe), key=lambda m: m.step
    )
    result = StageResult(stage, chain.run_id, checkpoints)
    for manifest in checkpoints if evaluate_all else checkpoints[-1:]:
        result.reports[manifest.partition] = evaluate_checkpoint(defs, instance, stage, manifest.partition)
    result.seconds = time.monotonic() - started
    return result


def stage_ops(instance: dg.DagsterInstance, stage: DemoStage, overrides: dict[str, Any]) -> dict[str, Any]:
    """The stage's chain ops config with ``overrides`` (``{op: {field: value}}``) applied and ``stage:<name>``
    references resolved to those stages' newest checkpoints."""
    ops = {name: {"config": {**op["config"], **overrides.get(name, {})}} for name, op in stage.run_config.items()}
    return resolve_stage_references(ops, lambda name: stage_checkpoint(instance, name))


def evaluate_checkpoint(defs: dg.Definitions, instance: dg.DagsterInstance, stage: DemoStage, partition: str) -> dict[str, dict[str, Any]]:
    """The stage's ``<recipe>_eval`` job on one checkpoint partition (with the stage's eval config); its report's rows."""
    eval_ops = {"ops": {f"{stage.recipe}_eval_report": {"config": stage.eval_config}}}
    run = defs.resolve_job_def(f"{stage.recipe}_eval").execute_in_process(
        instance=instance, partition_key=partition, run_config={**QUIET, **eval_ops}
    )
    if not run.success:
        raise RuntimeError(f"{stage.recipe}_eval of {partition} failed (run {run.run_id}); see `make ui`")
    return read_report(f"{stage.recipe}_eval_report", partition)


def run_benchmark_stage(defs: dg.Definitions, instance: dg.DagsterInstance, models: list[str], limit: int = DEMO_BENCHMARK_LIMIT) -> BenchmarkStageResult:
    """Each (model, benchmark) pair through the ``benchmark`` job, then the ``leaderboard``; ``models`` are
    partition keys of checkpoints or ``base:<model>``. A pair benchmarked before is run again (its newest result counts)."""
    started = time.monotonic()
    keys = [BenchmarkKey(model, benchmark) for model in models for benchmark in DEMO_BENCHMARKS]
    ensure_partitions(instance, keys)
    job = defs.resolve_job_def(BENCHMARK_JOB)
    # Every problem in flight at once: localtinker batches them into one decode loop per run.
    run_config = {**QUIET, "ops": {"benchmark_result": {"config": {"limit": limit, "max_connections": max(limit, 1)}}}}
    for key in keys:
        run = job.execute_in_process(instance=instance, partition_key=key.partition, run_config=run_config, tags={"posttrain/trigger": "demo"})
        if not run.success:
            raise RuntimeError(f"benchmark {key.partition} failed (run {run.run_id}); see `make ui`")
    metadata = refresh_leaderboard(instance, defs.resources["mlflow"], tags={"posttrain/trigger": "demo"}, run_config=QUIET)
    rows = board.rows_from_table(pq.read_table(metadata["table"]))
    shown = [row for row in rows if any(row.model == key.model and row.benchmark == key.benchmark for key in keys)]
    return BenchmarkStageResult([key.partition for key in keys], limit, board.text(shown), str(metadata["chart"]), time.monotonic() - started)


def run_demo(
    defs: dg.Definitions,
    overrides: dict[str, dict[str, Any]] | None = None,
    evaluate_all: bool = True,
    stages: tuple[DemoStage, ...] = STAGES,
    benchmark: bool = True,
) -> DemoResult:
    """``overrides``: per-op config overrides, e.g. ``{"sft_checkpoint": {"max_steps": 10}}``."""
    started = time.monotonic()
    home = ensure_dagster_home()
    tinker = defs.resources.get("tinker")
    if isinstance(tinker, TinkerResource):
        print(backend_line(tinker), flush=True)
    results = []
    benchmarks = None
    with dg.DagsterInstance.from_config(str(home)) as instance:
        for stage in stages:
            results.append(run_stage(defs, instance, stage, overrides or {}, evaluate_all))
            print(format_stage(results[-1]), flush=True)
        finals = [result.checkpoints[-1] for result in results if result.checkpoints and result.stage.benchmarked]
        if benchmark and finals:
            benchmarks = run_benchmark_stage(defs, instance, [base_key(finals[0].base_model), *(final.partition for final in finals)])
            print(format_benchmarks(benchmarks), flush=True)
    return DemoResult(results, time.monotonic() - started, benchmarks)


def backend_line(tinker: TinkerResource) -> str:
    """Where the demo trains, printed before its first stage: on the embedded localtinker, the device (a GPU's
    card) and the weights' dtype, so a user with a GPU sees it is used. Starts the embedded server, which the
    first stage would start anyway (one per process)."""
    with tinker.process_config_and_initialize_cm() as resolved:  # (environment variables resolved)
        described = resolved.describe()
    if described["tinker_backend"] == "remote":
        return "Tinker backend: hosted Tinker"
    if described.get("tinker_local_device"):
        return (f"Tinker backend: localtinker (embedded) on {described['tinker_local_device']}, "
                f"{described['tinker_local_dtype']}")
    return f"Tinker backend: localtinker at {described['tinker_base_url']}"


SHOWN_METRICS = ("accuracy", "reward", "pass@1", "pass@4", "pair_accuracy", "margin", "comparison_accuracy", "orders_agree",
                 "position_bias", "win_rate", "verdict_win_rate", "win_rate_verifier_tied", "nll", "bpb", "teacher_kl", "agreement")


def read_report(asset: str, partition: str) -> dict[str, dict[str, Any]]:
    """An eval report's rows by metric, from the parquet file the IO manager wrote for the partition."""
    table = pq.read_table(state_subdir("parquet") / asset / f"{partition}.parquet")
    return {row["metric"]: row for row in table.to_pylist()}


def _cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _delta(row: dict[str, Any]) -> str:
    against = "parent" if row["delta_parent"] is not None else "base"
    delta, stderr = row[f"delta_{against}"], row[f"delta_{against}_stderr"]
    if delta is None:
        return ""
    mark = {"better": " ▲", "worse": " ▼"}.get(row[f"vs_{against}"], "")
    return f"{delta:+.3f} ± {stderr:.3f}{mark} vs {against}"


def format_stage(result: StageResult) -> str:
    stage = result.stage
    title = stage.recipe if stage.label == stage.recipe else f"{stage.label} ({stage.recipe})"
    lines = [f"== {title}: {result.seconds:.0f} s, training run {result.chain_run_id}"]
    if result.checkpoints:
        lines.append(f"   MLflow run: {absolute_mlflow_url(result.checkpoints[-1].mlflow_run_url)}")
    lines.append(f"   {'checkpoint':<30} {'step':>4}  {'metric':<14} {'n':>4} {'base':>7} {'parent':>7} {'ckpt':>7}  Δ ± s.e.")
    for manifest in result.checkpoints:
        report = result.reports.get(manifest.partition)
        if report is None:
            lines.append(f"   {manifest.partition:<30} {manifest.step:>4}  (not evaluated)")
            continue
        shown = [metric for metric in SHOWN_METRICS if metric in report]
        for index, metric in enumerate(shown):
            row = report[metric]
            head = f"{manifest.partition:<30} {manifest.step:>4}" if index == 0 else " " * 35
            lines.append(
                f"   {head}  {metric:<14} {row['n']:>4} {_cell(row['base']):>7} {_cell(row['parent']):>7} {_cell(row['checkpoint']):>7}  {_delta(row)}"
            )
    return "\n".join(lines)


def format_benchmarks(result: BenchmarkStageResult) -> str:
    lines = [f"== leaderboard: {result.seconds:.0f} s, {len(result.partitions)} benchmark runs (limit {result.limit} each)"]
    lines += [f"   {line}" for line in result.leaderboard.splitlines()]
    lines += [f"   chart: {result.chart}", f"   transcripts: inspect view --log-dir {state_subdir('benchmarks')}"]
    return "\n".join(lines)


def format_demo(result: DemoResult) -> str:
    lines = [f"Demo finished in {result.seconds:.0f} s. State: {state_dir()}", ""]
    final = next((stage.checkpoints[-1] for stage in reversed(result.stages) if stage.checkpoints), None)
    if final is not None:
        lines += [
            f"final checkpoint: {final.state_path}",
            f"MLflow model:     {final.registered_model} v{final.model_version}",
            "",
            "Where to look:",
            "  make ui                 Dagster UI http://127.0.0.1:3000 (assets, runs, checks), MLflow UI http://127.0.0.1:5000",
            f"  .venv/bin/python -m pipelines lineage {final.registered_model}/{final.model_version}",
        ]
    return "\n".join(lines)
