"""One factory for every recipe's training asset: data in, chained LoRA checkpoints out, each registered.

A recipe supplies a :class:`TrainingSpec`: its name, its library config dataclass (the launchpad fields
are derived from it), the tables it trains on, the training assets ``init_from`` may name (graph edges),
and ``build``, which turns the loaded inputs into a ``posttrain`` recipe (+ evaluators, row sinks,
recipe-specific lineage). Everything else is here, once:

- the base model comes from the ``base_model`` asset; a token table rendered with another tokenizer is
  refused, naming both;
- ``init_from`` is resolved (``assets.chaining``) and the run starts from that checkpoint's weights;
- the training core (``posttrain.training.core.train``) runs with the run's MLflow run as metrics logger;
  the log directory is keyed by the *root* Dagster run id, so "re-execute from failure" resumes exactly;
- every checkpoint goes through the one registration path (``assets.registration``), including ones a
  killed attempt recorded but never registered;
- the Tinker session is closed ``errored`` with the reason when training fails.

Checkpoints are not passed through an IO manager (ARCHITECTURE §3): the asset returns a
``MaterializeResult`` with the paths, steps, final metrics and the MLflow link; its partitions are the
``<recipe>_checkpoints`` asset the eval reports hang off.
"""


import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

import dagster as dg
import pyarrow as pa

from assets.base_model import materialized_base_model
from assets.chaining import InitFromError, ParentCheckpoint, resolve_init_from
from assets.checkpoint_manifest import CheckpointManifest
from assets.config_bridge import dagster_config, library_config
from assets.registration import checkpoints_asset_key, partition_key, partitions_name, register_checkpoint
from assets.upstream import UpstreamVersion, inputs_of, latest_version, read_versioned_table
from posttrain.checkpoints import CheckpointRecord
from posttrain.datasets.tokens import TokenizerMismatch, check_tokenizer_matches, recorded_tokenizer
from posttrain.eval.base import Evaluator
from posttrain.metrics import ConsoleMetricsLogger
from posttrain.training.core import TrainingResult, train
from posttrain.training.recipe import Recipe, RowSink
from resources.mlflow import MlflowResource, MlflowRun
from resources.mlflow_links import registered_model_url
from resources.state import state_subdir
from resources.tinker import TinkerResource

BASE_MODEL_ASSET = "base_model"
CHECKPOINT_SUFFIX = "_checkpoint"  # training assets: lineage continues through their manifests, not their inputs
TRAINING_GROUP = "training"
TINKER_POOL = "tinker"  # concurrency pool: at most N runs hold Tinker capacity (dagster.yaml)


@dataclass
class RecipeInputs:
    """What ``TrainingSpec.build`` gets: the library config, the loaded tables and where they came from."""

    context: dg.AssetExecutionContext
    config: Any  # the recipe's library config (SupervisedConfig, DpoConfig, ...)
    launch_config: dg.Config  # the launchpad config, for Dagster-only fields
    tables: dict[str, pa.Table]
    versions: dict[str, UpstreamVersion]
    base_model: str
    parent: ParentCheckpoint | None
    tinker: TinkerResource
    log_dir: str

    def data_version(self, asset: str) -> str:
        return self.versions[asset].data_version

    @property
    def parent_sampler_path(self) -> str | None:
        """The parent checkpoint's sampler weights (the RL recipes' KL reference); None without a registered parent."""
        return self.parent.sampler_path if self.parent else None


@dataclass
class RecipeRun:
    """What ``TrainingSpec.build`` returns."""

    recipe: Recipe
    evaluators: Sequence[Evaluator] = ()
    row_sinks: Sequence[RowSink] = ()
    related: dict[str, Any] = field(default_factory=dict)  # recipe lineage into every manifest (teachers, reference ...)
    renderer: str = ""
    # Tables the recipe chose to read beyond its inputs (DPO's shared reference logprobs, when they match):
    # recorded in the manifest like the inputs, so a table read always has its version there.
    read: dict[str, UpstreamVersion] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainingSpec:
    recipe: str  # "sft", "dpo", "rl", "code_rl", "distill"
    library_config: type  # dataclass with a ``training: TrainingConfig`` field
    ins: Mapping[str, dg.AssetIn]  # tables the recipe trains on (parquet)
    build: Callable[[RecipeInputs], RecipeRun]
    parent_assets: tuple[str, ...] = ()  # training assets init_from may name: drawn as graph edges
    default_init_from: str = ""
    defaults: Mapping[str, Any] = field(default_factory=dict)  # launchpad defaults that differ from the library's
    extra_deps: tuple[str, ...] = ()  # further non-table upstream assets (e.g. a teacher's checkpoint asset)
    # A table chosen in the launchpad among several assets: (config field, asset names; the first is the
    # default). All are drawn as graph edges; the chosen one's latest version is read and recorded.
    input_choice: tuple[str, tuple[str, ...]] | None = None
    description: str = ""

    @property
    def asset_name(self) -> str:
        return f"{self.recipe}_checkpoint"

    @property
    def partitions(self) -> dg.DynamicPartitionsDefinition:
        return dg.DynamicPartitionsDefinition(name=partitions_name(self.recipe))

    @property
    def registered_model(self) -> str:
        return self.recipe


def training_config_class(spec: TrainingSpec) -> type[dg.Config]:
    name = "".join(part.title() for part in spec.recipe.split("_")) + "TrainingConfig"
    extra: dict[str, tuple[Any, Any, str]] = {}
    if spec.input_choice:
        field_name, options = spec.input_choice
        extra[field_name] = (Literal[options], options[0], f"Which table to train on: {', '.join(options)} (its latest version).")
    return dagster_config(
        name,
        spec.library_config,
        defaults=dict(spec.defaults),
        extra={
            **extra,
            "init_from": (
                str,
                spec.default_init_from,
                "Checkpoint to start from: empty = the base model; a tinker:// state path; a checkpoint partition key; "
                "latest:<recipe>; best:<recipe> (MLflow alias); or <registered model>/<version>.",
            )
        },
    )


def build_training_asset(spec: TrainingSpec) -> dg.AssetsDefinition:
    """The ``<recipe>_checkpoint`` asset for ``spec`` (see the module docstring)."""
    config_class = training_config_class(spec)

    def _train(context: dg.AssetExecutionContext, config, tinker: TinkerResource, mlflow: MlflowResource, **tables):
        return _materialize(spec, context, config, tinker, mlflow, tables)

    _train.__annotations__["config"] = config_class
    return dg.asset(
        name=spec.asset_name,
        group_name=TRAINING_GROUP,
        kinds={"tinker", "mlflow"},
        deps=[BASE_MODEL_ASSET, *spec.parent_assets, *spec.extra_deps, *(spec.input_choice[1] if spec.input_choice else ())],
        ins=dict(spec.ins),
        pool=TINKER_POOL,
        description=spec.description or f"{spec.recipe} LoRA training; every saved checkpoint becomes a `{partitions_name(spec.recipe)}` partition.",
    )(_train)


def build_checkpoints_asset(spec: TrainingSpec) -> dg.AssetSpec:
    """``<recipe>_checkpoints``: one partition per saved checkpoint, materialized by the training run.

    An external asset (its materializations are logged by the training asset), so re-training never
    marks the partitions of earlier runs, or their eval reports, stale.
    """
    return dg.AssetSpec(
        key=checkpoints_asset_key(spec.recipe),
        deps=[spec.asset_name],
        partitions_def=spec.partitions,
        group_name=TRAINING_GROUP,
        kinds={"tinker"},
        description=f"Every saved {spec.recipe} checkpoint, one partition each (key <recipe>-<run8>-<step>).",
    )


def _materialize(spec, context, config, tinker: TinkerResource, mlflow: MlflowResource, tables) -> dg.MaterializeResult:
    base = latest_version(context.instance, BASE_MODEL_ASSET)
    base_model = str(base.metadata.get("base_model", "")) or tinker.base_model
    tables = dict(tables)
    versions = {name: latest_version(context.instance, name) for name in spec.ins}
    if spec.input_choice:
        chosen = getattr(config, spec.input_choice[0])
        check_choice_is_fresh(context, spec.asset_name, spec.input_choice[0], chosen, spec.input_choice[1])
        versions[chosen] = latest_version(context.instance, chosen)
        tables[chosen] = read_versioned_table(versions[chosen].metadata, f"{chosen} (run {versions[chosen].run_id})")
    check_tokenizers(context, spec.asset_name, tables)
    try:
        parent = resolve_init_from(config.init_from, alias_lookup=mlflow.alias_partition, base_model=base_model)
    except InitFromError as error:
        raise dg.Failure(str(error)) from error
    training_run_id = context.run.root_run_id or context.run.run_id
    log_dir = str(state_subdir("training") / training_run_id)
    library = library_config(
        config, spec.library_config, log_dir=log_dir, base_model=base_model, init_from=parent.state_path if parent else None
    )
    inputs = RecipeInputs(context, library, config, tables, versions, base_model, parent, tinker, log_dir)
    recipe_run = spec.build(inputs)
    lineage = _Lineage(spec, context, base, {**versions, **recipe_run.read}, parent, recipe_run, base_model, training_run_id, log_dir)
    started = time.monotonic()
    with mlflow.start_run(
        context,
        run_name=f"{spec.recipe} {training_run_id[:8]}",
        tags={"posttrain.log_dir": log_dir, "posttrain.recipe": spec.recipe},
        resume_tag=("posttrain.log_dir", log_dir),
    ) as run, tinker.session(f"{spec.asset_name} {training_run_id[:8]}") as client:
        lineage.log_inputs(run, tinker)
        result = train(
            library.training,
            recipe_run.recipe,
            client,
            evaluators=recipe_run.evaluators,
            metrics_loggers=[run],
            row_sinks=recipe_run.row_sinks,
            progress_logger=ConsoleMetricsLogger(every_seconds=5.0, keys=("loss", "reward/mean", "learning_rate", "tokens_per_second")),
            on_checkpoint=lambda record: lineage.register(run, record),
        )
        registered_now = {record.name for record in result.new_checkpoints}
        for record in result.checkpoints:  # a resumed run registers what a killed attempt may have missed
            if record.name not in registered_now:
                lineage.register(run, record)
        run.set_tags({"posttrain.total_steps": result.total_steps, "posttrain.start_step": result.start_step})
    return dg.MaterializeResult(
        metadata=lineage.metadata(result, run, tinker, time.monotonic() - started),
        data_version=dg.DataVersion(partition_key(spec.recipe, training_run_id, result.final_checkpoint)),
    )


def check_choice_is_fresh(context: dg.AssetExecutionContext, consumer: str, field: str, chosen: str, options: Sequence[str]) -> None:
    """Refuse to read an older ``chosen`` table while this very run materializes another of ``options``
    (e.g. ``dpo_offline_chain`` makes preference_pairs, but ``pairs`` still names onpolicy_pairs)."""
    selected = context.run.asset_selection or context.job_def.asset_layer.selected_asset_keys
    selection = {key.to_user_string() for key in selected}
    fresh = [name for name in options if name in selection]
    if fresh and chosen not in fresh:
        raise dg.Failure(
            f"{consumer}: this run materializes {', '.join(fresh)}, but {field}={chosen!r} would read an older {chosen}; "
            f"set {field}: {fresh[0]} in {consumer}'s config"
        )


def check_tokenizers(context: dg.AssetExecutionContext, consumer: str, tables: Mapping[str, pa.Table]) -> None:
    """Refuse token tables rendered with another tokenizer than the base model's, naming both.

    Token tables record the tokenizer they were rendered with (``posttrain.datasets.tokens``); tables
    without tokens (problems, comparisons) record none and are not checked.
    """
    expected = materialized_base_model(context.instance, consumer).tokenizer
    for name, table in tables.items():
        if recorded_tokenizer(table) is None:
            continue
        try:
            check_tokenizer_matches(table, expected)
        except TokenizerMismatch as error:
            raise dg.Failure(f"{consumer}: {name}: {error}; re-materialize {name} after base_model") from error


# What MLflow's Datasets tab shows of each input table: size, and where its rows came from at which revision.
DATASET_PROFILE_KEYS = ("dagster/row_count", "source", "source_kind", "revision", "rows_read", "skipped_rows")


@dataclass
class _Lineage:
    """Everything a checkpoint of this run is traced back to, and how it is recorded."""

    spec: TrainingSpec
    context: dg.AssetExecutionContext
    base: UpstreamVersion
    versions: dict[str, UpstreamVersion]
    parent: ParentCheckpoint | None
    recipe_run: RecipeRun
    base_model: str
    training_run_id: str
    log_dir: str

    def upstream(self) -> dict[str, UpstreamVersion]:
        """The tables read, and every table they were made from, hop by hop (e.g. DPO's pairs → comparisons →
        problems). A checkpoint met on the way is recorded but not walked: its own manifest holds its lineage."""
        found = {BASE_MODEL_ASSET: self.base, **self.versions}
        pending = list(self.versions.values())
        while pending:
            for key, source in inputs_of(self.context.instance, pending.pop()).items():
                if key not in found:
                    found[key] = source
                    if not key.endswith(CHECKPOINT_SUFFIX):
                        pending.append(source)
        return found

    def upstream_json(self) -> dict[str, dict]:
        return {
            key: {"data_version": v.data_version, "dagster_run_id": v.run_id, "storage_id": v.storage_id, "metadata": v.metadata}
            for key, v in self.upstream().items()
        }

    def base_digest(self) -> str:
        return str(self.base.metadata.get("digest", self.base.data_version))

    def model_tags(self, record: CheckpointRecord, key: str) -> dict[str, str]:
        tags = {
            "tinker_path": record.state_path or "",
            "tinker_sampler_path": record.sampler_path or "",
            "step": str(record.batch),
            "recipe": self.spec.recipe,
            "base_model": self.base_model,
            "base_model.digest": self.base_digest(),
            "training_run": self.context.run.run_id,
            "dagster.partition": key,
            "init_from": self.parent.state_path if self.parent else "",
            "parent_partition": (self.parent.partition or "") if self.parent else "",
        }
        for name, version in self.upstream().items():
            if name != BASE_MODEL_ASSET:
                tags.update(version.as_tags(name))
        return tags

    def register(self, run: MlflowRun, record: CheckpointRecord) -> CheckpointManifest:
        key = partition_key(self.spec.recipe, self.training_run_id, record)
        manifest = CheckpointManifest(
            partition=key,
            recipe=self.spec.recipe,
            name=record.name,
            step=record.batch,
            epoch=record.epoch,
            final=record.final,
            state_path=record.state_path,
            sampler_path=record.sampler_path,
            base_model=self.base_model,
            base_model_digest=self.base_digest(),
            renderer=self.recipe_run.renderer,
            training_dagster_run_id=self.context.run.run_id,
            training_asset=self.spec.asset_name,
            log_dir=self.log_dir,
            mlflow_run_id=run.run_id,
            mlflow_run_url=run.url,
            registered_model=self.spec.registered_model,
            model_version="",
            upstream=self.upstream_json(),
            init_from=self.parent.state_path if self.parent else None,
            parent_partition=self.parent.partition if self.parent else None,
            tokenizer=f"{self.base.metadata.get('tokenizer_name', self.base_model)}@{str(self.base.metadata.get('tokenizer_digest', ''))[:16]}",
            related=dict(self.recipe_run.related),
        )
        metrics = {k: float(v) for k, v in record.extra.get("metrics", {}).items() if isinstance(v, (int, float))}
        return register_checkpoint(self.context, run, manifest, self.model_tags(record, key), metrics)

    def log_inputs(self, run: MlflowRun, tinker: TinkerResource) -> None:
        backend = tinker.describe()  # an embedded server's URL changes per process: a tag, not a param
        run.log_params({"tinker_backend": backend["tinker_backend"]})  # the core logs the config itself
        run.set_tags({**backend, "base_model.digest": self.base_digest(),
                      "posttrain.parent": self.parent.describe() if self.parent else "base model"})
        for name, version in self.upstream().items():
            if name == BASE_MODEL_ASSET:
                continue
            run.log_dataset(
                name,
                str(version.metadata.get("parquet/version_path") or version.metadata.get("source") or f"dagster://{name}"),
                digest=version.data_version or "unversioned",
                profile={key: version.metadata[key] for key in DATASET_PROFILE_KEYS if key in version.metadata},
            )

    def metadata(self, result: TrainingResult, run: MlflowRun, tinker: TinkerResource, seconds: float) -> dict[str, Any]:
        recipe = self.spec.recipe
        return {
            "checkpoints": dg.MetadataValue.json(
                [
                    {"partition": partition_key(recipe, self.training_run_id, r), "step": r.batch, "state_path": r.state_path, "sampler_path": r.sampler_path}
                    for r in result.checkpoints
                ]
            ),
            "final_partition": partition_key(recipe, self.training_run_id, result.final_checkpoint),
            "final_state_path": result.state_path or "",
            "final_sampler_path": result.sampler_path or "",
            "total_steps": result.total_steps,
            "resumed_from_step": result.start_step,
            "init_from": self.parent.describe() if self.parent else "base model",
            "wall_seconds": round(seconds, 2),
            **{f"final_{name}": float(value) for name, value in result.final_metrics.items() if isinstance(value, (int, float))},
            "base_model": self.base_model,
            "mlflow_run": dg.MetadataValue.url(run.url),
            "mlflow_model": dg.MetadataValue.url(registered_model_url(recipe)),  # its versions and their current aliases
            "log_dir": dg.MetadataValue.path(self.log_dir),
            **tinker.describe(),
        }
