"""Export automation: a job per recipe's ``<recipe>_export`` asset and the sensor that exports each ``best``.

The sensor ``export_best_checkpoints`` materializes the export partition of every checkpoint that becomes
its recipe's MLflow ``best``, once per checkpoint (its run key; a partition exported before, by hand or
by the CLI's asset, is not requested again). It is off unless configured: ``POSTTRAIN_EXPORT_BEST`` =
``adapter`` | ``merged`` | ``gguf`` starts it running and says what each export writes; without it the
sensor is stopped and, turned on in the UI, writes ``merged``. Runs carry the ``tinker`` pool (on the asset).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import dagster as dg

from assets.checkpoint_manifest import all_manifests
from assets.exports import build_export_asset
from assets.training import TrainingSpec
from pipelines.best import best_manifests
from resources.mlflow import MlflowResource

EXPORT_BEST_ENV = "POSTTRAIN_EXPORT_BEST"
EXPORT_BEST_SENSOR = "export_best_checkpoints"
FORMATS = {"adapter": {"merged": False, "gguf": False}, "merged": {"merged": True, "gguf": False}, "gguf": {"merged": True, "gguf": True}}


def export_format_from_env() -> str | None:
    """``POSTTRAIN_EXPORT_BEST`` checked, or None when it is unset (the sensor then starts stopped)."""
    value = os.environ.get(EXPORT_BEST_ENV, "").strip()
    if not value:
        return None
    if value not in FORMATS:
        raise ValueError(f"{EXPORT_BEST_ENV}={value!r}: use one of {sorted(FORMATS)} (or leave it unset to keep the sensor off)")
    return value


def export_job_name(recipe: str) -> str:
    return f"{recipe}_export_job"


def export_best_sensor(jobs: "dict[str, dg.UnresolvedAssetJobDefinition]", export_format: str | None) -> dg.SensorDefinition:
    """``jobs``: recipe → the job that materializes its export asset."""
    chosen = export_format or "merged"
    config = FORMATS[chosen]

    @dg.sensor(
        name=EXPORT_BEST_SENSOR,
        jobs=list(jobs.values()),
        minimum_interval_seconds=60,
        default_status=dg.DefaultSensorStatus.RUNNING if export_format else dg.DefaultSensorStatus.STOPPED,
        description=f"Exports ({chosen}) each checkpoint that becomes its recipe's MLflow `best`, once. Off unless "
        f"{EXPORT_BEST_ENV}=adapter|merged|gguf is set (or it is turned on here).",
    )
    def _sensor(context: dg.SensorEvaluationContext, mlflow: MlflowResource) -> Iterator[dg.RunRequest | dg.SkipReason]:
        manifests = [manifest for manifest in all_manifests() if manifest.state_path and manifest.recipe in jobs]
        requested = 0
        for manifest in best_manifests(manifests, mlflow):
            asset = dg.AssetKey(f"{manifest.recipe}_export")
            if manifest.partition in context.instance.get_materialized_partitions(asset):
                continue
            requested += 1
            yield dg.RunRequest(
                run_key=f"export:{manifest.partition}",
                job_name=export_job_name(manifest.recipe),
                partition_key=manifest.partition,
                run_config={"ops": {asset.to_python_identifier(): {"config": config}}},
                tags={"posttrain/trigger": "sensor:best"},
            )
        if not requested:
            yield dg.SkipReason(f"no new best checkpoint to export ({len(manifests)} checkpoint(s) with training state)")

    return _sensor


def export_definitions(trainings: Sequence[TrainingSpec], export_format: str | None = None) -> dg.Definitions:
    """Every recipe's export asset and job, and the sensor over them."""
    assets = {training.recipe: build_export_asset(training) for training in trainings}
    jobs = {
        recipe: dg.define_asset_job(
            export_job_name(recipe), selection=[asset], partitions_def=asset.partitions_def,
            description=f"Export one {recipe} checkpoint (PEFT adapter, merged model, GGUF), verified against the server.",
        )
        for recipe, asset in assets.items()
    }
    return dg.Definitions(assets=list(assets.values()), jobs=list(jobs.values()), sensors=[export_best_sensor(jobs, export_format)])
