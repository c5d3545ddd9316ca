"""One registration path for every recipe's checkpoints: MLflow model, manifest, partition, partition event.

``register_checkpoint`` makes a saved checkpoint visible everywhere, in an order where each write only
needs the ones before it, and where every write is idempotent:

1. ``mlflow_model``: the MLflow logged model + version of the recipe's registered model (found again by
   its ``tinker://`` path when it exists);
2. ``manifest``: ``<state>/checkpoints/<partition>.json`` (rewriting an identical manifest is a no-op);
3. ``partition``: the key added to the recipe's dynamic partitions (adding an existing key is a no-op);
4. ``partition_event``: a materialization of the ``<recipe>_checkpoints`` asset for that partition,
   logged by the training run (skipped when that partition is already materialized); the eval report's
   automation condition waits for it.

A kill between any two writes is repaired by calling it again (the training asset re-registers every
recorded checkpoint after training, so "re-execute from failure" completes the registration); no write is
ever done twice. ``AFTER_WRITE`` lets tests stop the process between writes.
"""

from __future__ import annotations

from typing import Callable

import dagster as dg

from assets.checkpoint_manifest import CheckpointManifest, write_manifest
from posttrain.checkpoints import CheckpointRecord
from resources.mlflow import MlflowRun
from resources.mlflow_links import registered_model_url

REGISTRATION_WRITES = ("mlflow_model", "manifest", "partition", "partition_event")
AFTER_WRITE: Callable[[str, str], None] | None = None  # (write name, partition key); tests raise here


def checkpoints_asset_key(recipe: str) -> dg.AssetKey:
    return dg.AssetKey(f"{recipe}_checkpoints")


def partitions_name(recipe: str) -> str:
    return f"{recipe}_checkpoints"


def partition_key(recipe: str, training_run_id: str, record: CheckpointRecord) -> str:
    """``<recipe>-<run8>-<step name>``: unique across recipes and training runs, sortable within one."""
    return f"{recipe}-{training_run_id[:8]}-{record.name}"


def _done(write: str, key: str) -> None:
    if AFTER_WRITE is not None:
        AFTER_WRITE(write, key)


def register_checkpoint(
    context: dg.AssetExecutionContext,
    run: MlflowRun,
    manifest: CheckpointManifest,
    model_tags: dict[str, str],
    step_metrics: dict[str, float],
) -> CheckpointManifest:
    """Registers ``manifest``'s checkpoint (see the module docstring); returns it with its MLflow ids."""
    key = manifest.partition
    if not manifest.state_path:
        raise ValueError(f"checkpoint {key} has no state_path: only saved training states are registered")
    registered = run.register_checkpoint(
        manifest.registered_model, manifest.state_path, model_tags,
        step=manifest.step, metrics=step_metrics, metrics_step=max(manifest.step - 1, 0),
    )
    _done("mlflow_model", key)
    manifest.model_version = str(registered.version)
    manifest.mlflow_model_id = registered.model_id or ""
    write_manifest(manifest)
    _done("manifest", key)
    instance = context.instance
    name = partitions_name(manifest.recipe)
    if not instance.has_dynamic_partition(name, key):
        instance.add_dynamic_partitions(name, [key])
    _done("partition", key)
    asset_key = checkpoints_asset_key(manifest.recipe)
    if key not in instance.get_materialized_partitions(asset_key):
        context.log_event(
            dg.AssetMaterialization(
                asset_key=asset_key,
                partition=key,
                description=f"{manifest.recipe} checkpoint at step {manifest.step}",
                metadata={
                    "state_path": manifest.state_path or "",
                    "sampler_path": manifest.sampler_path or "",
                    "step": manifest.step,
                    "parent": manifest.parent_partition or (manifest.init_from or "base model"),
                    "mlflow_model": f"{manifest.registered_model}/{manifest.model_version}",
                    "mlflow_model_version": dg.MetadataValue.url(registered.model_version_url),
                    # The aliases (best, latest-evaluated) move with later evals: link the page that shows them now.
                    "mlflow_aliases": dg.MetadataValue.url(registered_model_url(manifest.registered_model)),
                    "training_run": manifest.training_dagster_run_id,
                },
                tags={"dagster/data_version": manifest.state_path or key},
            )
        )
    _done("partition_event", key)
    context.log.info(
        f"checkpoint {key}: {manifest.state_path} → MLflow model {manifest.registered_model} v{manifest.model_version}"
    )
    return manifest
