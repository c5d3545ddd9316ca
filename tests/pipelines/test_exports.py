"""The export asset on a real SFT checkpoint partition: files, verification figures, MLflow attachment."""

import json

import dagster as dg

from assets.checkpoint_manifest import read_manifest
from assets.exports import build_export_asset
from assets.sft import SFT
from tests.fixtures.dagster_env import tiny_resources


def test_export_asset_writes_verified_models_and_attaches_them_to_mlflow(sft_pipeline_run, monkeypatch):
    run = sft_pipeline_run
    for name, value in run.env.items():
        monkeypatch.setenv(name, value)
    partition = run.requested_partitions[-1]
    result = dg.materialize(
        [build_export_asset(SFT)], partition_key=partition, instance=run.instance, resources=tiny_resources(run.state),
        run_config={"ops": {"sft_export": {"config": {"merged": True}}}},
    )
    assert result.success
    metadata = result.asset_materializations_for_node("sft_export")[0].metadata
    assert metadata["within_tolerance"].value is True
    assert metadata["adapter_max_abs_logprob_diff"].value <= 1e-4 and metadata["merged_max_abs_logprob_diff"].value <= 1e-3
    target = run.state / "exports" / partition
    assert {p.name for p in target.iterdir()} == {"adapter", "merged", "export.json", "README.md"}
    manifest = read_manifest(partition)
    assert json.loads((target / "export.json").read_text())["path"] == manifest.state_path
    assert f"`{manifest.registered_model}`" in (target / "README.md").read_text()
    version = run.mlflow.get_client().get_model_version(manifest.registered_model, manifest.model_version)
    assert float(version.tags["export.adapter_max_abs_logprob_diff"]) <= 1e-4
    assert metadata["mlflow_logged_model"].value == manifest.mlflow_model_id != ""
