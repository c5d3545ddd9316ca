"""Eval reports for every recipe, from one factory: a checkpoint against its base model and its parent.

``build_eval_asset(spec)`` makes ``<recipe>_eval_report``, partitioned like ``<recipe>_checkpoints``
(one report per saved checkpoint). For the partition's checkpoint (its manifest, never "the newest
file") it
- loads the **exact data versions the checkpoint was trained on** (the versioned parquet files recorded
  in its manifest), so a re-materialized dataset never changes an old checkpoint's numbers and held-out
  rows are the ones held out from *that* run;
- runs the recipe's evaluators (``spec.evaluators``: NLL/bpb, greedy task accuracy, pass@k, pair
  accuracy ... from ``posttrain.eval``) on the checkpoint, its base model and its parent (``init_from``);
  base and parent scores are cached by (model, data versions, eval config), so ten checkpoints score the
  base once;
- writes one ``metric | n | base | parent | checkpoint | Δ ± s.e.`` table (means over held-out items, the
  difference paired on the same items, marked when beyond 2 s.e.) as parquet, markdown in the UI, an MLflow
  run (and the numbers onto the training run's curve and the model version's tags), keeps the MLflow
  aliases ``latest`` and ``best`` (by ``spec.score_metric``) of the recipe's registered model current,
  and a WARN check when the checkpoint is worse than its base model by more than 2 paired s.e.

Every new checkpoint is evaluated once without anyone asking: the asset's automation condition is
``on_missing`` (a partition added by training, whose checkpoint partition is materialized), run by the
automation sensor in ``pipelines``. It depends only on its own ``<recipe>_checkpoints`` partition (an
external asset), so a new training run does not mark earlier reports stale.
"""


import hashlib
import json
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import dagster as dg
import pyarrow as pa
from pydantic import Field, create_model

from assets.checkpoint_manifest import CheckpointManifest, read_manifest
from assets.registration import checkpoints_asset_key
from assets.training import TrainingSpec
from assets.upstream import read_versioned_table
from posttrain.atomic_files import write_text_atomically
from posttrain.eval.base import EvalTarget, Evaluator
from posttrain.eval.items import ItemScores, mean_metrics, score_items
from posttrain.eval.report import comparison_rows, higher_is_better, markdown, report_table, worse
from resources.mlflow import MlflowResource, metric_name
from resources.models import load_tokenizer
from resources.state import state_subdir
from resources.tinker import TinkerResource

EVAL_GROUP = "eval"
IMPROVES_CHECK = "improves_on_base"


class EvalConfig(dg.Config):
    max_heldout_sequences: int = Field(default=64, description="Held-out token sequences scored for NLL/bpb (0 = all).")
    max_problems: int = Field(default=48, description="Held-out problems sampled for task accuracy / pass@k (0 = all).")
    max_tokens: int = Field(default=32, description="Sampling budget per answer.")
    pass_k: int = Field(default=4, description="k of pass@k (samples per problem at temperature 1); 0 = skip pass@k.")
    seed: int = Field(default=0, description="Sampling seed (greedy top_k=1, so only ties depend on it).")


@dataclass
class EvalInputs:
    """What ``EvalSpec.evaluators`` gets: the checkpoint, its exact training data, tokenizer and settings."""

    manifest: CheckpointManifest
    tables: dict[str, pa.Table]  # asset key -> the version the checkpoint was trained on
    tokenizer: Any
    config: EvalConfig
    tinker: TinkerResource | None = None  # for evaluators that need other models (a distillation teacher's KL)


@dataclass(frozen=True)
class EvalSpec:
    training: TrainingSpec
    data_assets: tuple[str, ...]  # upstream tables the evaluators read: those of them recorded in the manifest
    evaluators: Callable[[EvalInputs], Sequence[Evaluator]]
    score_metric: str = "accuracy"  # the held-out task score the MLflow alias `best` follows
    config_defaults: Mapping[str, Any] = field(default_factory=dict)  # EvalConfig defaults that differ for this recipe

    @property
    def asset_name(self) -> str:
        return f"{self.training.recipe}_eval_report"


def load_trained_version(manifest: CheckpointManifest, asset: str) -> pa.Table:
    """The exact table version ``manifest``'s checkpoint was trained on (its versioned parquet file)."""
    recorded = manifest.upstream.get(asset)
    if recorded is None:
        raise dg.Failure(f"checkpoint {manifest.partition} records no {asset!r} input; it was not trained on {asset}")
    return read_versioned_table(recorded.get("metadata", {}), f"{asset} version {recorded.get('data_version')!r} of checkpoint {manifest.partition}")


def trained_assets(spec: EvalSpec, manifest: CheckpointManifest) -> list[str]:
    """Those of ``spec.data_assets`` the checkpoint's manifest records (a recipe choosing among tables read one)."""
    found = [asset for asset in spec.data_assets if asset in manifest.upstream]
    if not found:
        raise dg.Failure(f"checkpoint {manifest.partition} records none of {list(spec.data_assets)}: it was trained on none of them")
    return found


def eval_config_class(spec: EvalSpec) -> type[EvalConfig]:
    """``EvalConfig`` with the recipe's own defaults (e.g. a longer answer budget for code)."""
    if not spec.config_defaults:
        return EvalConfig
    unknown = sorted(set(spec.config_defaults) - set(EvalConfig.model_fields))
    if unknown:
        raise ValueError(f"EvalSpec for {spec.training.recipe!r}: config_defaults {unknown} are not EvalConfig fields {sorted(EvalConfig.model_fields)}")
    fields = {
        key: (EvalConfig.model_fields[key].annotation, Field(default=value, description=EvalConfig.model_fields[key].description))
        for key, value in spec.config_defaults.items()
    }
    name = "".join(part.title() for part in spec.training.recipe.split("_")) + "EvalConfig"
    return create_model(name, __base__=EvalConfig, **fields)


def build_eval_asset(spec: EvalSpec) -> dg.AssetsDefinition:
    name = spec.asset_name
    recipe = spec.training.recipe
    config_class = eval_config_class(spec)

    @dg.asset(
        name=name,
        group_name=EVAL_GROUP,
        kinds={"tinker", "mlflow", "parquet"},
        partitions_def=spec.training.partitions,
        deps=[checkpoints_asset_key(recipe)],
        automation_condition=dg.AutomationCondition.on_missing(),
        check_specs=[dg.AssetCheckSpec(IMPROVES_CHECK, asset=name, description="WARN when the checkpoint is worse than its base model.")],
        description=f"Held-out evaluation of one {recipe} checkpoint against its base model and its parent.",
    )
    def _eval(context: dg.AssetExecutionContext, config: config_class, tinker: TinkerResource, mlflow: MlflowResource):
        manifest = read_manifest(context.partition_key)
        if not manifest.sampler_path:
            raise dg.Failure(f"checkpoint {manifest.partition} has no sampler weights to evaluate ({manifest.state_path})")
        started = time.monotonic()
        data_assets = trained_assets(spec, manifest)
        inputs = EvalInputs(
            manifest=manifest,
            tables={asset: load_trained_version(manifest, asset) for asset in data_assets},
            tokenizer=load_tokenizer(manifest.base_model),
            config=config,
            tinker=tinker,
        )
        evaluators = list(spec.evaluators(inputs))
        with tinker.session(f"{name} {manifest.partition}") as client:
            items = score_items(evaluators, EvalTarget.from_checkpoint(client, manifest.sampler_path, inputs.tokenizer))
            base = _cached_scores(context, spec, inputs, "base", manifest.base_model_digest,
                                  lambda: EvalTarget.from_base_model(client, manifest.base_model, inputs.tokenizer), evaluators)
            parent = _parent_scores(context, spec, inputs, client, evaluators)
        rows = comparison_rows(items, base, parent)
        scores = mean_metrics(items)
        title = f"**{manifest.partition}** (step {manifest.step}) vs base `{manifest.base_model}`" + (
            f" and parent `{manifest.parent_partition or manifest.init_from}`" if parent is not None else ""
        )
        report = markdown(rows, title, has_parent=parent is not None)
        with mlflow.start_run(context, run_name=f"eval {manifest.partition}", tags={"posttrain.checkpoint": manifest.partition}) as run:
            run.log_params({"checkpoint": manifest.partition, "sampler_path": manifest.sampler_path, **config.model_dump()})
            for asset in data_assets:
                version = manifest.upstream[asset]
                run.log_dataset(asset, str(version["metadata"].get("parquet/version_path")), version["data_version"] or "unversioned", context="eval")
            run.log_metrics(_flat(rows), step=manifest.step)
            run.log_text(report, "eval_report.md")
            _annotate_training(run.client, manifest, scores)
        score = scores.get(spec.score_metric)
        aliases = mlflow.update_aliases(
            manifest.registered_model, manifest.model_version, score, higher_is_better=higher_is_better(spec.score_metric) is not False
        )
        context.log.info(f"MLflow aliases of {manifest.registered_model} now: {aliases} (`best` by held-out {spec.score_metric})")
        bad = worse(rows, "base")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dg.BetaWarning)  # data_version on Output is beta in 1.13; we rely on it
            output = dg.Output(
                report_table(rows),
                metadata={
                    "report": dg.MetadataValue.md(report),
                    "checkpoint": manifest.partition,
                    "sampler_path": manifest.sampler_path,
                    "base_model": manifest.base_model,
                    "parent": manifest.parent_partition or manifest.init_from or "base model",
                    "data_versions": dg.MetadataValue.json({a: manifest.upstream[a]["data_version"] for a in data_assets}),
                    "score_metric": spec.score_metric,
                    "mlflow_run": dg.MetadataValue.url(run.url),
                    "training_mlflow_run": dg.MetadataValue.url(manifest.mlflow_run_url),
                    "wall_seconds": round(time.monotonic() - started, 2),
                },
                data_version=dg.DataVersion(hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]),
            )
        yield output
        yield dg.AssetCheckResult(
            check_name=IMPROVES_CHECK,
            passed=not bad,
            severity=dg.AssetCheckSeverity.WARN,
            metadata={"worse_than_base": ", ".join(bad) or "none", "report": dg.MetadataValue.md(report)},
        )

    return _eval


SCORES_FORMAT = 2
"""Part of each cached base / parent score's key. Raise it when an evaluator gains or changes a metric: a cache
written before would leave that metric's base and parent columns blank (or stale) in every later report."""


def _cache_key(spec: EvalSpec, inputs: EvalInputs, model: str) -> str:
    key = json.dumps(
        {
            "scores": SCORES_FORMAT,
            "model": model,
            "recipe": spec.training.recipe,
            "data": {asset: inputs.manifest.upstream[asset]["data_version"] for asset in inputs.tables},
            "renderer": inputs.manifest.renderer,
            "related": inputs.manifest.related,  # e.g. distillation teachers: the base's teacher_kl depends on them
            "config": inputs.config.model_dump(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def _cached_scores(context, spec, inputs, label, model_identity, make_target, evaluators) -> ItemScores:
    """Per-item scores of a reference model (base or parent), cached by model identity + data versions + eval config."""
    cache = state_subdir("eval_cache") / f"{label}-{_cache_key(spec, inputs, model_identity)}.json"
    if cache.exists():
        context.log.info(f"{label} model scores from cache {cache}")
        return json.loads(cache.read_text())
    scores = score_items(evaluators, make_target())
    write_text_atomically(cache, json.dumps(scores))  # concurrent evals of one base model race to write it
    return scores


def _parent_scores(context, spec, inputs, client, evaluators) -> ItemScores | None:
    manifest = inputs.manifest
    if not manifest.init_from:
        return None
    parent_sampler = _parent_sampler_path(manifest)
    if parent_sampler is None:
        context.log.warning(f"parent {manifest.init_from} has no registered sampler weights: report compares with the base only")
        return None
    return _cached_scores(context, spec, inputs, "parent", parent_sampler,
                          lambda: EvalTarget.from_checkpoint(client, parent_sampler, inputs.tokenizer), evaluators)


def _parent_sampler_path(manifest: CheckpointManifest) -> str | None:
    if manifest.parent_partition:
        return read_manifest(manifest.parent_partition).sampler_path
    return None


def _flat(rows: list[dict[str, Any]]) -> dict[str, float]:
    """MLflow metrics: each model's mean and s.e., n, and the paired differences (``eval/`` is the checkpoint)."""
    metrics: dict[str, Any] = {}
    for row in rows:
        name = row["metric"]
        metrics.update({f"eval/{name}": row["checkpoint"], f"eval/{name}_stderr": row["checkpoint_stderr"], f"eval/{name}_n": row["n"]})
        metrics.update({f"base/{name}": row["base"], f"parent/{name}": row["parent"]})
        metrics.update({f"delta_base/{name}": row["delta_base"], f"delta_parent/{name}": row["delta_parent"]})
    return {name: float(value) for name, value in metrics.items() if isinstance(value, (int, float)) and not math.isnan(value)}


def _annotate_training(client, manifest: CheckpointManifest, scores: dict[str, float]) -> None:
    """Eval numbers onto the training run's curve (at the checkpoint's step) and the model version's tags."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    finite = {k: v for k, v in scores.items() if isinstance(v, (int, float)) and not math.isnan(v)}
    client.log_batch(manifest.mlflow_run_id, metrics=[Metric(metric_name(f"checkpoint_eval/{k}"), v, now, manifest.step) for k, v in finite.items()])
    for name, value in finite.items():
        client.set_model_version_tag(manifest.registered_model, manifest.model_version, metric_name(f"eval.{name}"), f"{value:.6g}")
