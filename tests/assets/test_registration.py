"""One registration path, idempotent: a kill between any two of its writes is repaired by running it again."""

import dagster as dg
import pytest

import assets.registration as registration
from assets.checkpoint_manifest import CheckpointManifest, all_manifests
from assets.registration import REGISTRATION_WRITES, register_checkpoint
from resources.mlflow import MlflowResource

KEY = "sft-abcd1234-000010"


class _Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (BaseException, so no handler swallows it)."""


def _manifest() -> CheckpointManifest:
    return CheckpointManifest(
        partition=KEY, recipe="sft", name="000010", step=10, epoch=0, final=False,
        state_path="tinker://run-1/weights/000010", sampler_path="tinker://run-1/sampler_weights/000010",
        base_model="m", base_model_digest="d", renderer="chatml", training_dagster_run_id="r", training_asset="sft_checkpoint",
        log_dir="/tmp/x", mlflow_run_id="", mlflow_run_url="", registered_model="sft", model_version="",
    )



@dg.asset(name="registering")
def registering(context: dg.AssetExecutionContext, mlflow: MlflowResource) -> None:
    with mlflow.start_run(context, run_name="registering") as run:
        manifest = _manifest()
        manifest.mlflow_run_id, manifest.mlflow_run_url = run.run_id, run.url
        register_checkpoint(context, run, manifest, {"dagster.partition": KEY}, {"loss": 1.5})


@pytest.mark.parametrize("killed_after", REGISTRATION_WRITES[:-1])
def test_a_kill_between_two_writes_is_repaired_by_registering_again(killed_after, dagster_instance, project_state, mlflow_resource, monkeypatch):
    def kill(write, key):
        if write == killed_after:
            raise _Killed()

    monkeypatch.setattr(registration, "AFTER_WRITE", kill)
    with pytest.raises(_Killed):
        dg.materialize([registering], instance=dagster_instance, resources={"mlflow": mlflow_resource}, raise_on_error=True)
    monkeypatch.setattr(registration, "AFTER_WRITE", None)
    assert dg.materialize([registering], instance=dagster_instance, resources={"mlflow": mlflow_resource}).success
    assert dg.materialize([registering], instance=dagster_instance, resources={"mlflow": mlflow_resource}).success  # and again

    client = mlflow_resource.get_client()
    versions = client.search_model_versions("name = 'sft'")
    assert len(versions) == 1 and versions[0].tags["dagster.partition"] == KEY
    (manifest,) = all_manifests()
    assert manifest.partition == KEY and manifest.model_version == str(versions[0].version)
    assert dagster_instance.get_dynamic_partitions("sft_checkpoints") == [KEY]
    events = dagster_instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("sft_checkpoints"), asset_partitions=[KEY]), limit=10
    ).records
    assert len(events) == 1
    metadata = events[0].asset_materialization.metadata
    assert metadata["state_path"].value == "tinker://run-1/weights/000010"
    # Links relative to the Dagster UI (its /mlflow redirect follows the MLflow UI's port); aliases are not a snapshot.
    assert metadata["mlflow_model_version"].value == f"/mlflow/#/models/sft/versions/{versions[0].version}"
    assert metadata["mlflow_aliases"].value == "/mlflow/#/models/sft"
