"""Eval reports, one per checkpoint partition: the checkpoint against its base model on held-out data.

For the partition's checkpoint (looked up by partition key in its manifest, never "the newest file")
and for the base model it was trained from, the asset measures
- held-out NLL and bits per byte on the ``heldout`` split of the rendered tokens, and
- sampled task accuracy (greedy) on the ``heldout`` conversations of the chat dataset: the last user
  turn is the question, the last assistant turn the gold answer,
then stores a ``metric | base | checkpoint | delta | better`` table as parquet, shows it as markdown,
logs it to its own MLflow run (and onto the training run's eval curve and the model version's tags),
and raises a WARN asset check when the checkpoint is worse than the base model.

Base-model numbers depend only on the base weights, the held-out data and the eval settings, so they
are cached under the state dir keyed by those digests: evaluating ten checkpoints scores the base once.
"""

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass

import dagster as dg
import pyarrow as pa
from pydantic import Field

from assets.checkpoint_manifest import CheckpointManifest, read_manifest
from assets.checkpoints import CHECKPOINTS, TOKENS_ASSET, TRAINING_ASSET
from assets.upstream import latest_version
from posttrain.datasets.schemas import HELDOUT_SPLIT
from posttrain.eval.accuracy import TaskProblem, evaluate_accuracy
from posttrain.eval.base import EvalTarget
from posttrain.eval.nll import evaluate_nll
from posttrain.supervised.data import RenderedTokens
from resources.mlflow import MlflowResource
from resources.models import load_tokenizer
from resources.state import state_subdir
from resources.tinker import TinkerResource

CHAT_ASSET = "chat_dataset"
IMPROVES_CHECK = "improves_on_base"
LOWER_IS_BETTER = {"nll": True, "bpb": True, "accuracy": False}


class EvalConfig(dg.Config):
    max_heldout_sequences: int = Field(default=64, description="Held-out token sequences scored for NLL/bpb (0 = all).")
    max_problems: int = Field(default=48, description="Held-out conversations sampled for task accuracy (0 = all).")
    max_tokens: int = Field(default=32, description="Sampling budget per answer.")
    seed: int = Field(default=0, description="Sampling seed (greedy top_k=1, so only ties depend on it).")


@dataclass(frozen=True)
class ModelScores:
    nll: float
    bpb: float
    accuracy: float
    num_sequences: int
    num_problems: int

    def metric(self, name: str) -> float:
        return getattr(self, name)


def problems_from_chat(table: pa.Table, limit: int) -> list[TaskProblem]:
    """Held-out conversations as question/gold-answer problems (last user turn, last assistant turn)."""
    problems = []
    for row in table.to_pylist():
        if row.get("split") != HELDOUT_SPLIT:
            continue
        messages = row["messages"]
        users = [m["content"] for m in messages if m["role"] == "user"]
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        systems = [m["content"] for m in messages if m["role"] == "system"]
        if users and answers:
            problems.append(
                TaskProblem(question=users[-1], answer=answers[-1], row_id=row["row_id"], system=systems[0] if systems else None)
            )
    return problems[:limit] if limit else problems


def score_model(
    target: EvalTarget, renderer, tokenizer, heldout: RenderedTokens, problems: list[TaskProblem], config: EvalConfig
) -> tuple[ModelScores, list[dict]]:
    count = len(heldout) if not config.max_heldout_sequences else min(len(heldout), config.max_heldout_sequences)
    nll = evaluate_nll(target, heldout.data_at(range(count)), tokenizer)
    accuracy = evaluate_accuracy(target, renderer, problems, max_tokens=config.max_tokens, seed=config.seed)
    scores = ModelScores(nll.nll, nll.bits_per_byte, accuracy.accuracy, count, accuracy.num_samples)
    return scores, accuracy.row_dicts()


def report_table(base: ModelScores, checkpoint: ModelScores) -> pa.Table:
    rows = []
    for name, lower_is_better in LOWER_IS_BETTER.items():
        delta = checkpoint.metric(name) - base.metric(name)
        rows.append(
            {
                "metric": name,
                "base": base.metric(name),
                "checkpoint": checkpoint.metric(name),
                "delta": delta,
                "better": bool(delta < 0 if lower_is_better else delta > 0),
            }
        )
    return pa.Table.from_pylist(rows)


def worse_than_base(table: pa.Table) -> list[str]:
    """Metrics on which the checkpoint is strictly worse than its base model (equal is not worse)."""
    worse = []
    for row in table.to_pylist():
        lower_is_better = LOWER_IS_BETTER[row["metric"]]
        if (row["delta"] > 0) if lower_is_better else (row["delta"] < 0):
            worse.append(row["metric"])
    return worse


def markdown(table: pa.Table, manifest: CheckpointManifest) -> str:
    lines = [
        f"**{manifest.partition}** (step {manifest.step}) vs base `{manifest.base_model}`",
        "",
        "| metric | base | checkpoint | delta | |",
        "|---|---:|---:|---:|---|",
    ]
    for row in table.to_pylist():
        mark = "better" if row["better"] else ("equal" if row["delta"] == 0 else "worse")
        lines.append(f"| {row['metric']} | {row['base']:.4f} | {row['checkpoint']:.4f} | {row['delta']:+.4f} | {mark} |")
    return "\n".join(lines)


@dg.asset(
    group_name="eval",
    kinds={"tinker", "mlflow", "parquet"},
    partitions_def=CHECKPOINTS,
    deps=[TRAINING_ASSET],
    ins={TOKENS_ASSET: dg.AssetIn(), CHAT_ASSET: dg.AssetIn()},
    check_specs=[
        dg.AssetCheckSpec(
            IMPROVES_CHECK, asset="eval_report", description="WARN when the checkpoint is worse than its base model."
        )
    ],
)
def eval_report(
    context: dg.AssetExecutionContext,
    config: EvalConfig,
    rendered_tokens: pa.Table,
    chat_dataset: pa.Table,
    tinker: TinkerResource,
    mlflow: MlflowResource,
):
    """Held-out NLL/bpb and task accuracy of one checkpoint, next to its base model's."""
    manifest = read_manifest(context.partition_key)
    if not manifest.sampler_path:
        raise dg.Failure(f"checkpoint {manifest.partition} has no sampler weights to evaluate ({manifest.state_path})")
    started = time.monotonic()
    tokenizer = load_tokenizer(manifest.base_model)
    renderer = _renderer(manifest.renderer, tokenizer)
    heldout = RenderedTokens(rendered_tokens, split=HELDOUT_SPLIT)
    problems = problems_from_chat(chat_dataset, config.max_problems)
    if len(heldout) == 0 or not problems:
        raise dg.Failure(
            f"no held-out data: {len(heldout)} held-out token rows, {len(problems)} held-out conversations; "
            "materialize the data assets with a held-out fraction > 0"
        )
    client = tinker.get_client()
    checkpoint_scores, samples = score_model(
        EvalTarget.from_checkpoint(client, manifest.sampler_path), renderer, tokenizer, heldout, problems, config
    )
    base_scores = _base_scores(context, client, manifest, renderer, tokenizer, heldout, problems, config)
    table = report_table(base_scores, checkpoint_scores)
    report = markdown(table, manifest)
    with mlflow.start_run(context, run_name=f"eval {manifest.partition}", tags={"posttrain.checkpoint": manifest.partition}) as run:
        run.log_params({"checkpoint": manifest.partition, "sampler_path": manifest.sampler_path, **config.model_dump()})
        run.log_dataset(TOKENS_ASSET, f"dagster://{TOKENS_ASSET}", _version(context, TOKENS_ASSET), context="eval")
        run.log_dataset(CHAT_ASSET, f"dagster://{CHAT_ASSET}", _version(context, CHAT_ASSET), context="eval")
        run.log_metrics(_flat(checkpoint_scores, base_scores), step=manifest.step)
        run.log_text(report, "eval_report.md")
        run.log_dict(samples, "samples.json")
        _annotate_training(run.client, manifest, checkpoint_scores)
    worse = worse_than_base(table)
    yield dg.Output(
        table,
        metadata={
            "report": dg.MetadataValue.md(report),
            "checkpoint": manifest.partition,
            "sampler_path": manifest.sampler_path,
            "base_model": manifest.base_model,
            **{f"checkpoint_{k}": v for k, v in asdict(checkpoint_scores).items()},
            **{f"base_{k}": v for k, v in asdict(base_scores).items()},
            "mlflow_run": dg.MetadataValue.url(run.url),
            "training_mlflow_run": dg.MetadataValue.url(manifest.mlflow_run_url),
            "wall_seconds": round(time.monotonic() - started, 2),
        },
    )
    yield dg.AssetCheckResult(
        check_name=IMPROVES_CHECK,
        passed=not worse,
        severity=dg.AssetCheckSeverity.WARN,
        metadata={"worse_than_base": ", ".join(worse) or "none", "report": dg.MetadataValue.md(report)},
    )


def _renderer(name: str, tokenizer):
    from posttrain.datasets.tokens import get_renderer  # the same lookup rendered_tokens used

    return get_renderer(name or "chatml", tokenizer)


def _version(context: dg.AssetExecutionContext, key: str) -> str:
    return latest_version(context.instance, key).data_version or "unversioned"


def _flat(checkpoint: ModelScores, base: ModelScores) -> dict[str, float]:
    metrics = {f"eval/{name}": checkpoint.metric(name) for name in LOWER_IS_BETTER}
    metrics.update({f"base/{name}": base.metric(name) for name in LOWER_IS_BETTER})
    metrics.update({f"delta/{name}": checkpoint.metric(name) - base.metric(name) for name in LOWER_IS_BETTER})
    return {name: value for name, value in metrics.items() if not math.isnan(value)}


def _base_scores(context, client, manifest, renderer, tokenizer, heldout, problems, config) -> ModelScores:
    key = json.dumps(
        {
            "base": manifest.base_model_digest,
            "tokens": _version(context, TOKENS_ASSET),
            "chat": _version(context, CHAT_ASSET),
            "renderer": manifest.renderer,
            "config": config.model_dump(),
        },
        sort_keys=True,
    )
    cache = state_subdir("eval_cache") / f"base-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    if cache.exists():
        context.log.info(f"base model scores from cache {cache}")
        return ModelScores(**json.loads(cache.read_text()))
    scores, _ = score_model(
        EvalTarget.from_base_model(client, manifest.base_model), renderer, tokenizer, heldout, problems, config
    )
    cache.write_text(json.dumps(asdict(scores)))
    return scores


def _annotate_training(client, manifest: CheckpointManifest, scores: ModelScores) -> None:
    """Eval numbers onto the training run's curve (at the checkpoint's step) and the model version's tags."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client.log_batch(
        manifest.mlflow_run_id,
        metrics=[Metric(f"checkpoint_eval/{n}", scores.metric(n), now, manifest.step) for n in LOWER_IS_BETTER if not math.isnan(scores.metric(n))],
    )
    for name in LOWER_IS_BETTER:
        client.set_model_version_tag(manifest.registered_model, manifest.model_version, f"eval.{name}", f"{scores.metric(name):.6g}")
