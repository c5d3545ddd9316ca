"""Exports in the code location on a real SFT checkpoint partition: the sensor that follows `best` (real Dagster
instance, real MLflow store), and the export asset's files, verification figures and MLflow attachment."""

import json
from pathlib import Path

import dagster as dg
import pytest

from assets.checkpoint_manifest import read_manifest
from assets.exports import build_export_asset
from assets.sft import SFT
from pipelines.exports import EXPORT_BEST_ENV, EXPORT_BEST_SENSOR, export_definitions, export_format_from_env
from resources.mlflow import ALIAS_BEST
from tests.fixtures.dagster_env import tiny_resources


def test_the_best_export_sensor_is_off_unless_configured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def sensor(export_format: str | None) -> dg.SensorDefinition:
        defs = dg.Definitions.merge(export_definitions([SFT], export_format), dg.Definitions(resources=tiny_resources(tmp_path)))
        return defs.resolve_sensor_def(EXPORT_BEST_SENSOR)

    monkeypatch.delenv(EXPORT_BEST_ENV, raising=False)
    assert export_format_from_env() is None
    assert sensor(None).default_status == dg.DefaultSensorStatus.STOPPED
    monkeypatch.setenv(EXPORT_BEST_ENV, "gguf")
    assert sensor(export_format_from_env()).default_status == dg.DefaultSensorStatus.RUNNING
    monkeypatch.setenv(EXPORT_BEST_ENV, "onnx")
    with pytest.raises(ValueError, match="adapter.*gguf.*merged"):
        export_format_from_env()
    assert build_export_asset(SFT).op.pool == "tinker"


def test_the_sensor_exports_the_best_checkpoint_once_verified_and_attached_to_mlflow(sft_pipeline_run, monkeypatch):
    run = sft_pipeline_run
    for name, value in run.env.items():
        monkeypatch.setenv(name, value)
    best = run.mlflow.alias_partition(read_manifest(run.requested_partitions[-1]).registered_model, ALIAS_BEST)
    defs = dg.Definitions.merge(export_definitions([SFT], "merged"), dg.Definitions(resources=tiny_resources(run.state)))
    sensor = defs.resolve_sensor_def(EXPORT_BEST_SENSOR)
    with dg.build_sensor_context(instance=run.instance, resources={"mlflow": run.mlflow}) as context:
        requests = list(sensor(context))
    assert [(r.partition_key, r.job_name, r.run_key) for r in requests] == [(best, "sft_export_job", f"export:{best}")]
    assert requests[0].run_config == {"ops": {"sft_export": {"config": {"merged": True, "gguf": False}}}}

    result = defs.resolve_job_def("sft_export_job").execute_in_process(
        instance=run.instance, partition_key=best, run_config=requests[0].run_config, tags=requests[0].tags
    )
    assert result.success
    metadata = result.asset_materializations_for_node("sft_export")[0].metadata
    assert metadata["within_tolerance"].value is True
    assert metadata["adapter_max_abs_logprob_diff"].value <= 1e-4 and metadata["merged_max_abs_logprob_diff"].value <= 1e-3
    target = run.state / "exports" / best
    assert {p.name for p in target.iterdir()} == {"adapter", "merged", "export.json", "README.md"}
    manifest = read_manifest(best)
    assert json.loads((target / "export.json").read_text())["path"] == manifest.state_path
    assert f"`{manifest.registered_model}`" in (target / "README.md").read_text()
    version = run.mlflow.get_client().get_model_version(manifest.registered_model, manifest.model_version)
    assert float(version.tags["export.adapter_max_abs_logprob_diff"]) <= 1e-4
    assert metadata["mlflow_logged_model"].value == manifest.mlflow_model_id != ""

    with dg.build_sensor_context(instance=run.instance, resources={"mlflow": run.mlflow}) as context:
        again = list(sensor(context))
    assert [type(item) for item in again] == [dg.SkipReason]  # exported once: not requested again
