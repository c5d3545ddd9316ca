"""Standard benchmarks of any checkpoint or base model (``benchmark_result``), and the ``leaderboard`` joining them.

``benchmark_result`` is partitioned by one dynamic key per (model, benchmark) pair,
``<model key>|<benchmark>``, where the model key is a checkpoint partition of any recipe
(``sft-1a2b3c4d-000010``) or ``base:<base model>``: each pair is materialized once and can be
re-materialized on its own. A run samples through the inspect provider ``tinker/<sampler path>``
(posttrain.benchmarks) with the checkpoint's own renderer and keeps, under
``<state>/benchmarks/<model>/<benchmark>/``, the inspect log (``inspect view --log-dir`` that folder),
``samples.parquet`` (one score per sample) and ``result.json`` (metric, value, stderr, n). A checkpoint's
registered-model version is tagged ``benchmark.<name>`` (+ ``.stderr``, ``.n``) and the result's MLflow run logs
the metrics against the checkpoint's logged model; with the MLflow
resource's ``best_follows`` set to that benchmark, the recipe's ``best`` alias follows it. Runs hold the
``tinker`` pool like training. A failure (unknown task, missing checkpoint, dataset missing offline,
an eval error) raises before anything is written: no log, no files, no tag, no materialization.

``leaderboard`` reads the newest result of every partition and writes one table (models × benchmarks,
with base and parent rows and paired Δ vs parent), a PNG chart and an MLflow run; its ``eager``
automation condition refreshes it after every new result.
"""

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from assets.checkpoint_manifest import CheckpointManifest, read_manifest
from assets.training import TINKER_POOL
from posttrain.atomic_files import staged, write_text_atomically
from posttrain.benchmarks import leaderboard as board
from posttrain.benchmarks.results import BenchmarkResult
from posttrain.benchmarks.runner import ModelTarget, run_benchmark
from posttrain.renderers.registry import DEFAULT_RENDERER
from resources.mlflow import MlflowResource
from resources.mlflow_links import registered_model_url
from resources.models import tokenizer_path
from resources.state import state_subdir
from resources.tinker import TinkerResource

BENCHMARK_GROUP = "benchmarks"
BENCHMARK_PARTITIONS = dg.DynamicPartitionsDefinition(name="benchmark_runs")
BASE_PREFIX = "base:"
KEY_SEPARATOR = "|"
RESULT_FILE = "result.json"
SAMPLES_FILE = "samples.parquet"


@dataclass(frozen=True)
class BenchmarkKey:
    """One partition of ``benchmark_result``: a model (checkpoint partition or ``base:<model>``) and a benchmark."""

    model: str
    benchmark: str

    @property
    def partition(self) -> str:
        return f"{self.model}{KEY_SEPARATOR}{self.benchmark}"

    @property
    def is_base(self) -> bool:
        return self.model.startswith(BASE_PREFIX)

    @classmethod
    def parse(cls, partition: str) -> "BenchmarkKey":
        model, separator, benchmark = partition.rpartition(KEY_SEPARATOR)
        if not separator or not model or not benchmark:
            raise ValueError(
                f"benchmark partition {partition!r} is not '<checkpoint key or base:<model>>|<benchmark>' "
                "(e.g. 'sft-1a2b3c4d-000010|gsm8k' or 'base:HuggingFaceTB/SmolLM2-135M-Instruct|mmlu')"
            )
        return cls(model, benchmark)


def base_key(base_model: str) -> str:
    return f"{BASE_PREFIX}{base_model}"


def result_dir(key: BenchmarkKey) -> Path:
    """``<state>/benchmarks/<model>/<benchmark>``, with path-unsafe characters of either part replaced."""
    return state_subdir("benchmarks") / _safe(key.model) / _safe(key.benchmark)


def ensure_partitions(instance: dg.DagsterInstance, keys: list[BenchmarkKey]) -> list[BenchmarkKey]:
    """Adds the partitions not yet known; returns those it added (the ones to run)."""
    new = [key for key in dict.fromkeys(keys) if not instance.has_dynamic_partition(BENCHMARK_PARTITIONS.name, key.partition)]
    if new:
        instance.add_dynamic_partitions(BENCHMARK_PARTITIONS.name, [key.partition for key in new])
    return new


class BenchmarkConfig(dg.Config):
    limit: int = Field(default=0, description="Samples per benchmark (0 = the whole test set).")
    max_tokens: int = Field(default=0, description="Answer budget in tokens (0 = the benchmark's own default).")
    task_args: str = Field(default="{}", description='Task arguments as JSON, e.g. {"fewshot": 5} for gsm8k.')
    max_connections: int = Field(default=64, description="Requests in flight at once (localtinker batches them).")
    base_renderer: str = Field(default=DEFAULT_RENDERER, description="Renderer for base models (checkpoints use their own).")


@dg.asset(
    name="benchmark_result",
    group_name=BENCHMARK_GROUP,
    kinds={"tinker", "mlflow", "parquet"},
    partitions_def=BENCHMARK_PARTITIONS,
    pool=TINKER_POOL,
    description="One standard benchmark (inspect-ai) of one checkpoint or base model: metric ± s.e., n, per-sample scores, inspect log.",
)
def benchmark_result(context: dg.AssetExecutionContext, config: BenchmarkConfig, tinker: TinkerResource, mlflow: MlflowResource) -> dg.MaterializeResult:
    key = BenchmarkKey.parse(context.partition_key)
    manifest = None if key.is_base else _manifest(key.model)
    target = model_target(key, manifest, tinker, config.base_renderer)
    directory = result_dir(key)
    started = time.monotonic()
    result = run_benchmark(
        key.benchmark, target, directory,
        limit=config.limit or None, task_args=_task_args(config), max_connections=config.max_connections,
    )
    try:  # a failure past this point takes the kept log back: the pair has a whole result or none
        run_url, aliases = _record_in_mlflow(context, mlflow, key, manifest, result, config)
        samples_path, summary_path = _write_result(directory, key, result)
    except BaseException:
        Path(result.log_path).unlink(missing_ok=True)
        raise
    context.log.info(f"{key.partition}: {result.metric} {result.value:.4f} ± {result.stderr:.4f} (n={result.n}); log {result.log_path}")
    return dg.MaterializeResult(
        metadata={
            "model": key.model,
            "benchmark": key.benchmark,
            "task": result.task,  # the leaderboard's column: the task's own name (a task file's @task)
            "metric": result.metric,
            "value": result.value,
            "stderr": result.stderr,
            "n": result.n,
            "inspect_model": result.model,
            "renderer": target.renderer,
            "limit": config.limit,
            "inspect_log": dg.MetadataValue.path(result.log_path),
            "view": f"inspect view --log-dir {directory}",
            "samples": dg.MetadataValue.path(str(samples_path)),
            "result": dg.MetadataValue.path(str(summary_path)),
            "inspect_metrics": dg.MetadataValue.json(result.inspect_metrics),
            "mlflow_run": dg.MetadataValue.url(run_url),
            # Aliases move after this run: link to the page that shows them now, and say what this run moved.
            **({"mlflow_aliases": dg.MetadataValue.url(registered_model_url(manifest.registered_model))} if manifest else {}),
            "aliases_moved_at_materialization": ", ".join(f"{alias} → v{version}" for alias, version in aliases.items()) or "none",
            "wall_seconds": round(time.monotonic() - started, 2),
        },
        data_version=dg.DataVersion(Path(result.log_path).stem),
    )


def model_target(key: BenchmarkKey, manifest: CheckpointManifest | None, tinker: TinkerResource, base_renderer: str) -> ModelTarget:
    """The provider's target for ``key``: the checkpoint's sampler weights and renderer, or the base model."""
    endpoint = tinker.endpoint()
    if manifest is None:
        name = key.model[len(BASE_PREFIX):]
        return ModelTarget(name, base_renderer, endpoint.base_url, endpoint.api_key, tokenizer_path(name))
    return ModelTarget(manifest.sampler_path or "", manifest.renderer, endpoint.base_url, endpoint.api_key, tokenizer_path(manifest.base_model))


def _record_in_mlflow(context, mlflow: MlflowResource, key: BenchmarkKey, manifest: CheckpointManifest | None,
                      result: BenchmarkResult, config: BenchmarkConfig) -> tuple[str, dict[str, int]]:
    """An MLflow run with the result; for a checkpoint, its metrics linked to the checkpoint's logged model
    (they show on the model's page) and ``benchmark.<name>`` tags on its registered-model version."""
    name = _safe(result.task)
    with mlflow.start_run(context, run_name=f"benchmark {key.partition}", tags={"posttrain.benchmark": result.task, "posttrain.model": key.model}) as run:
        run.log_params({"model": key.model, "benchmark": key.benchmark, "inspect_model": result.model, "limit": config.limit,
                        "inspect_log": result.log_path})
        model_id = (manifest.mlflow_model_id or None) if manifest is not None else None
        step = manifest.step if manifest is not None else 0
        for metric, value in ((f"benchmark/{name}", result.value), (f"benchmark/{name}_stderr", result.stderr), (f"benchmark/{name}_n", float(result.n))):
            if not math.isnan(value):
                run.client.log_metric(run.run_id, metric, value, step=step, model_id=model_id)
        run.log_dict(result.summary(), "benchmark_result.json")
    aliases = {}
    if manifest is not None:
        aliases = mlflow.record_benchmark(manifest.registered_model, manifest.model_version, result.task, result.value, result.stderr, result.n)
    return run.url, aliases


def _manifest(partition: str) -> CheckpointManifest:
    try:
        manifest = read_manifest(partition)
    except FileNotFoundError as error:
        raise dg.Failure(f"benchmark of checkpoint {partition!r}: {error}", allow_retries=False) from error
    if not manifest.sampler_path:
        raise dg.Failure(f"checkpoint {partition!r} has no sampler weights to benchmark (state {manifest.state_path})", allow_retries=False)
    return manifest


def _task_args(config: BenchmarkConfig) -> dict[str, Any]:
    try:
        args = json.loads(config.task_args or "{}")
    except json.JSONDecodeError as error:
        raise dg.Failure(f"task_args {config.task_args!r} is not JSON ({error.msg}); write e.g. '{{\"fewshot\": 5}}'", allow_retries=False) from error
    if not isinstance(args, dict):
        raise dg.Failure(f"task_args must be a JSON object, got {config.task_args!r}", allow_retries=False)
    if config.max_tokens:
        args["max_tokens"] = config.max_tokens
    return args


def _write_result(directory: Path, key: BenchmarkKey, result: BenchmarkResult) -> tuple[Path, Path]:
    samples = pa.Table.from_pylist(result.samples)
    samples_path = directory / SAMPLES_FILE
    with staged(samples_path) as staging:
        pq.write_table(samples, staging, compression="zstd")
    summary_path = directory / RESULT_FILE
    write_text_atomically(summary_path, json.dumps({**result.summary(), "partition": key.partition, "inspect_metrics": result.inspect_metrics}, indent=2))
    return samples_path, summary_path


def _safe(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "--", part).strip("-") or "_"


# -- leaderboard -----------------------------------------------------------------------------------


@dg.asset(
    name="leaderboard",
    group_name=BENCHMARK_GROUP,
    kinds={"mlflow", "parquet"},
    deps=[benchmark_result],
    automation_condition=dg.AutomationCondition.eager(),
    description="Every benchmarked checkpoint and base model × every benchmark: value ± s.e. (n), paired Δ vs parent, PNG chart.",
)
def leaderboard(context: dg.AssetExecutionContext, mlflow: MlflowResource) -> dg.MaterializeResult:
    cells = latest_cells(context.instance)
    if not cells:
        raise dg.Failure("no benchmark results yet: run `python -m pipelines benchmark <checkpoint> --task gsm8k` first", allow_retries=False)
    models = [model_entry(model_key) for model_key in sorted({model for model, _ in cells})]
    rows = board.build_rows(models, cells)
    directory = state_subdir("benchmarks")
    table = board.table(rows)
    with staged(directory / "leaderboard.parquet") as staging:
        pq.write_table(table, staging)
    text = board.markdown(rows)
    write_text_atomically(directory / "leaderboard.md", text + "\n")
    png = directory / "leaderboard.png"
    with staged(png) as staging:
        board.chart(rows, staging)
    with mlflow.start_run(context, run_name="leaderboard") as run:
        run.log_text(text, "leaderboard.md")
        run.client.log_artifact(run.run_id, str(png))
        run.log_metrics({_metric_key(row): row.value for row in rows if not math.isnan(row.value)}, step=0)
    return dg.MaterializeResult(
        metadata={
            "leaderboard": dg.MetadataValue.md(text),
            "chart": dg.MetadataValue.path(str(png)),
            "table": dg.MetadataValue.path(str(directory / "leaderboard.parquet")),
            "models": len(models),
            "results": len(rows),
            "mlflow_run": dg.MetadataValue.url(run.url),
        }
    )


def latest_cells(instance: dg.DagsterInstance) -> dict[tuple[str, str], board.Cell]:
    """The newest materialization of every ``benchmark_result`` partition, with its per-sample scores."""
    cells: dict[tuple[str, str], board.Cell] = {}
    for partition in instance.get_dynamic_partitions(BENCHMARK_PARTITIONS.name):
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=benchmark_result.key, asset_partitions=[partition]), limit=1
        ).records
        if not records:
            continue
        metadata = {name: getattr(value, "value", value) for name, value in records[0].asset_materialization.metadata.items()}
        key = BenchmarkKey.parse(partition)
        task = str(metadata.get("task", key.benchmark))
        cells[(key.model, task)] = board.Cell(
            benchmark=task, metric=str(metadata["metric"]), value=float(metadata["value"]),
            stderr=float(metadata["stderr"]), n=int(metadata["n"]), scores=_sample_scores(Path(str(metadata["samples"]))),
            log=str(metadata.get("inspect_log", "")),
        )
    return cells


def model_entry(model_key: str) -> board.ModelEntry:
    if model_key.startswith(BASE_PREFIX):
        return board.ModelEntry(model_key, model_key, "base", 0, None)
    try:
        manifest = read_manifest(model_key)
    except FileNotFoundError:
        return board.ModelEntry(model_key, model_key, "unknown", 0, None)
    parent = manifest.parent_partition or base_key(manifest.base_model)
    return board.ModelEntry(model_key, model_key, manifest.recipe, manifest.step, parent)


def _sample_scores(path: Path) -> dict[str, float]:
    if not path.exists():
        return {}
    rows = pq.read_table(path, columns=["sample_id", "score"]).to_pylist()
    sums: dict[str, list[float]] = {}
    for row in rows:
        sums.setdefault(row["sample_id"], []).append(row["score"])
    return {sample: sum(values) / len(values) for sample, values in sums.items()}


def _metric_key(row: board.Row) -> str:
    return _safe(f"{row.benchmark}.{row.model}")


BENCHMARK_ASSETS = [benchmark_result, leaderboard]
