"""The SFT training asset: rendered tokens + base model → LoRA checkpoints on Tinker.

A thin wrapper over ``posttrain.supervised.train_supervised``: the loop, its resume logic and its
checkpoint log live in posttrain; this asset binds it to the Tinker resource, opens one MLflow run,
and turns every saved checkpoint into

1. a manifest file (``assets.checkpoint_manifest``) holding its tinker paths and lineage,
2. an MLflow model version whose tags name the tinker path, base model, training run and data versions,
3. a partition of the dynamic ``checkpoints`` partitions (added last, so whoever sees the partition
   can read 1 and 2) — the eval sensor picks it up from there.

Checkpoints are not passed through an IO manager (ARCHITECTURE §3): the asset returns a
``MaterializeResult`` with the paths, steps, final metrics and the MLflow link.

Resume: the log directory is keyed by the *root* Dagster run id, so "re-execute from failure" of a run
killed mid-training continues from its last checkpoint with its optimizer state, in the same MLflow run.
"""

import time
from dataclasses import dataclass

import dagster as dg
import pyarrow as pa
from pydantic import Field

from assets.checkpoint_manifest import CheckpointManifest, manifest_path, write_manifest
from assets.upstream import UpstreamVersion, inputs_of, latest_version
from posttrain.checkpoints import CheckpointRecord
from posttrain.datasets.schemas import HELDOUT_SPLIT, TRAIN_SPLIT
from posttrain.eval.nll import NllEvaluator
from posttrain.metrics import ConsoleMetricsLogger
from posttrain.supervised.config import SupervisedConfig
from posttrain.supervised.data import RenderedTokens
from posttrain.supervised.loop import train_supervised
from resources.mlflow import MlflowResource, MlflowRun
from resources.state import state_subdir
from resources.tinker import TinkerResource

CHECKPOINTS = dg.DynamicPartitionsDefinition(name="checkpoints")
TRAINING_ASSET = "sft_checkpoint"
TOKENS_ASSET = "rendered_tokens"
BASE_MODEL_ASSET = "base_model"


class SftConfig(dg.Config):
    """Every field has a default so the launchpad, a sensor or `make demo` can start a run as is."""

    base_model: str = Field(default="", description="Base model to fine-tune. Empty: the materialized base_model asset.")
    renderer: str = Field(
        default="", description="Chat renderer the tokens were made with. Empty: read from rendered_tokens' metadata."
    )
    learning_rate: float = Field(default=5e-4, description="Peak Adam learning rate (LoRA).")
    lr_schedule: str = Field(default="linear", description="linear | cosine | constant, applied per step.")
    warmup_steps: int = Field(default=0, description="Linear warm-up steps before the schedule.")
    num_epochs: int = Field(default=1, description="Passes over the training split.")
    batch_size: int = Field(default=8, description="Examples per optimizer step.")
    lora_rank: int = Field(default=16, description="LoRA rank.")
    save_every: int = Field(default=10, description="Steps between checkpoints (each one a `checkpoints` partition); 0 = final only.")
    eval_every: int = Field(default=0, description="Steps between held-out NLL/bpb evaluations; 0 = after the last step.")
    max_steps: int = Field(default=0, description="Cap on optimizer steps; 0 = every batch of every epoch.")
    seed: int = Field(default=0, description="Data order and LoRA initialisation seed.")
    loss_reduction: str = Field(default="example_mean", description="sum | example_mean | token_mean.")
    registered_model: str = Field(default="sft", description="MLflow registered model the checkpoints become versions of.")


@dataclass(frozen=True)
class TrainingLineage:
    """Everything a checkpoint of this run is traced back to."""

    dagster_run_id: str
    base_model: str
    base: UpstreamVersion
    tokens: UpstreamVersion
    dataset: UpstreamVersion | None
    renderer: str

    def model_version_tags(self, record: CheckpointRecord, partition: str) -> dict[str, str]:
        tags = {
            "tinker_path": record.state_path or "",
            "tinker_sampler_path": record.sampler_path or "",
            "step": str(record.batch),
            "base_model": self.base_model,
            "base_model.digest": str(self.base.metadata.get("digest", self.base.data_version)),
            "training_run": self.dagster_run_id,
            "dagster.partition": partition,
            "renderer": self.renderer,
            **self.tokens.as_tags(TOKENS_ASSET),
        }
        if self.dataset is not None:
            tags.update(self.dataset.as_tags(self.dataset.asset_key))
        return tags

    def upstream_json(self) -> dict[str, dict]:
        versions = [self.base, self.tokens] + ([self.dataset] if self.dataset else [])
        return {
            version.asset_key: {
                "data_version": version.data_version,
                "dagster_run_id": version.run_id,
                "storage_id": version.storage_id,
                "metadata": version.metadata,
            }
            for version in versions
        }


def partition_key(training_run_id: str, record: CheckpointRecord) -> str:
    """``sft-<run8>-<step name>``: unique across training runs, sortable within one."""
    return f"sft-{training_run_id[:8]}-{record.name}"


@dg.asset(
    group_name="training",
    kinds={"tinker", "mlflow"},
    deps=[BASE_MODEL_ASSET],
    ins={TOKENS_ASSET: dg.AssetIn()},
)
def sft_checkpoint(
    context: dg.AssetExecutionContext,
    config: SftConfig,
    rendered_tokens: pa.Table,
    tinker: TinkerResource,
    mlflow: MlflowResource,
) -> dg.MaterializeResult:
    """LoRA SFT on the train split of the rendered tokens; every saved checkpoint becomes a partition."""
    lineage = _lineage(context, config)
    training_run_id = context.run.root_run_id or context.run.run_id
    supervised = SupervisedConfig(
        base_model=lineage.base_model,
        lora_rank=config.lora_rank,
        learning_rate=config.learning_rate,
        lr_schedule=config.lr_schedule,
        warmup_steps=config.warmup_steps,
        loss_reduction=config.loss_reduction,
        batch_size=config.batch_size,
        num_epochs=config.num_epochs,
        max_steps=config.max_steps or None,
        seed=config.seed,
        log_dir=str(state_subdir("training") / training_run_id),
        save_every=config.save_every,
        eval_every=config.eval_every,
    )
    dataset = RenderedTokens(rendered_tokens, split=TRAIN_SPLIT)
    heldout = RenderedTokens(rendered_tokens, split=HELDOUT_SPLIT)
    evaluators = [NllEvaluator(heldout.all_data())] if len(heldout) else []
    with mlflow.start_run(
        context,
        run_name=f"sft {training_run_id[:8]}",
        tags={"posttrain.log_dir": supervised.log_dir},
        resume_tag=("posttrain.log_dir", supervised.log_dir),
    ) as run:
        _log_inputs(run, lineage, tinker)
        registered: dict[str, CheckpointManifest] = {}

        def on_checkpoint(record: CheckpointRecord) -> None:
            manifest = _register_checkpoint(context, run, lineage, config, supervised, training_run_id, record)
            registered[manifest.partition] = manifest

        started = time.monotonic()
        result = train_supervised(
            supervised,
            dataset,
            tinker.get_client(),
            evaluators=evaluators,
            metrics_loggers=[run],
            progress_logger=ConsoleMetricsLogger(every_seconds=5.0, keys=("loss", "learning_rate", "tokens_per_second")),
            on_checkpoint=on_checkpoint,
        )
        for record in result.checkpoints:  # a resumed run re-registers what a killed one may have missed
            key = partition_key(training_run_id, record)
            if key not in registered and not manifest_path(key).exists():
                registered[key] = _register_checkpoint(context, run, lineage, config, supervised, training_run_id, record)
        run.set_tags({"posttrain.total_steps": result.total_steps, "posttrain.start_step": result.start_step})

    final_key = partition_key(training_run_id, result.final_checkpoint)
    return dg.MaterializeResult(
        metadata={
            "checkpoints": dg.MetadataValue.json(
                [
                    {"partition": partition_key(training_run_id, r), "step": r.batch, "state_path": r.state_path, "sampler_path": r.sampler_path}
                    for r in result.checkpoints
                ]
            ),
            "final_partition": final_key,
            "final_state_path": result.state_path or "",
            "final_sampler_path": result.sampler_path or "",
            "total_steps": result.total_steps,
            "resumed_from_step": result.start_step,
            "train_examples": len(dataset),
            "wall_seconds": round(time.monotonic() - started, 2),
            **{f"final_{name}": float(value) for name, value in result.final_metrics.items()},
            "base_model": lineage.base_model,
            "renderer": lineage.renderer,
            "mlflow_run": dg.MetadataValue.url(run.url),
            "log_dir": dg.MetadataValue.path(supervised.log_dir),
            **tinker.describe(),
        },
        data_version=dg.DataVersion(final_key),
    )


def _lineage(context: dg.AssetExecutionContext, config: SftConfig) -> TrainingLineage:
    base = latest_version(context.instance, BASE_MODEL_ASSET)
    tokens = latest_version(context.instance, TOKENS_ASSET)
    datasets = list(inputs_of(context.instance, tokens).values())
    materialized_model = str(base.metadata.get("base_model", ""))
    base_model = config.base_model or materialized_model
    if config.base_model and materialized_model and config.base_model != materialized_model:
        raise dg.Failure(
            f"SftConfig.base_model={config.base_model!r} differs from the materialized base_model asset "
            f"({materialized_model!r}); re-materialize base_model with that name, or leave base_model empty."
        )
    tokens_renderer = str(tokens.metadata.get("renderer", ""))
    if config.renderer and tokens_renderer and config.renderer != tokens_renderer:
        raise dg.Failure(
            f"SftConfig.renderer={config.renderer!r} but rendered_tokens were rendered with {tokens_renderer!r}; "
            "re-materialize rendered_tokens with that renderer, or leave renderer empty."
        )
    return TrainingLineage(
        dagster_run_id=context.run.run_id,
        base_model=base_model,
        base=base,
        tokens=tokens,
        dataset=datasets[0] if datasets else None,
        renderer=config.renderer or tokens_renderer,
    )


def _log_inputs(run: MlflowRun, lineage: TrainingLineage, tinker: TinkerResource) -> None:
    backend = tinker.describe()  # an embedded server's URL changes per process: a tag, not a param
    run.log_params({"base_model": lineage.base_model, "renderer": lineage.renderer, "tinker_backend": backend["tinker_backend"]})
    run.set_tags({**backend, "base_model.digest": lineage.base.metadata.get("digest", lineage.base.data_version)})
    run.log_dataset(
        TOKENS_ASSET,
        str(lineage.tokens.metadata.get("path", f"dagster://{TOKENS_ASSET}")),
        digest=lineage.tokens.data_version or "unversioned",
        profile={key: lineage.tokens.metadata[key] for key in ("dagster/row_count",) if key in lineage.tokens.metadata},
    )
    if lineage.dataset is not None:
        run.log_dataset(
            lineage.dataset.asset_key,
            str(lineage.dataset.metadata.get("source", f"dagster://{lineage.dataset.asset_key}")),
            digest=lineage.dataset.data_version or "unversioned",
        )


def _register_checkpoint(
    context: dg.AssetExecutionContext,
    run: MlflowRun,
    lineage: TrainingLineage,
    config: SftConfig,
    supervised: SupervisedConfig,
    training_run_id: str,
    record: CheckpointRecord,
) -> CheckpointManifest:
    key = partition_key(training_run_id, record)
    version = run.register_checkpoint(config.registered_model, record.state_path or "", lineage.model_version_tags(record, key))
    manifest = CheckpointManifest(
        partition=key,
        name=record.name,
        step=record.batch,
        epoch=record.epoch,
        final=record.final,
        state_path=record.state_path,
        sampler_path=record.sampler_path,
        base_model=lineage.base_model,
        base_model_digest=str(lineage.base.metadata.get("digest", lineage.base.data_version)),
        renderer=lineage.renderer,
        training_dagster_run_id=context.run.run_id,
        training_asset=TRAINING_ASSET,
        log_dir=supervised.log_dir,
        mlflow_run_id=run.run_id,
        mlflow_run_url=run.url,
        registered_model=version.name,
        model_version=str(version.version),
        upstream=lineage.upstream_json(),
    )
    write_manifest(manifest)
    context.instance.add_dynamic_partitions(CHECKPOINTS.name, [key])
    context.log.info(f"checkpoint {key}: {record.state_path} → MLflow model {version.name} v{version.version}")
    return manifest
