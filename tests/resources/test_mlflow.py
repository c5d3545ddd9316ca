"""MlflowResource inside real Dagster materializations against a real sqlite MLflow store."""

import json

import dagster as dg
import pytest
from mlflow.entities import RunStatus

from resources.mlflow import TAG_ASSET_KEY, TAG_DAGSTER_RUN_ID, TAG_PARTITION, MlflowResource

PARTITIONS = dg.StaticPartitionsDefinition(["ckpt-a", "ckpt-b"])


@dg.asset(partitions_def=PARTITIONS)
def tracked(context: dg.AssetExecutionContext, mlflow: MlflowResource) -> dg.MaterializeResult:
    with mlflow.start_run(context, run_name="tracked") as run:
        run.log_params({"learning_rate": 1e-3, "batch_size": 4})
        for step in range(3):
            run.log_metrics({"loss": 3.0 - step, "loss:sum": 30.0 - step, "note": "skipped"}, step=step)
        run.log_dataset("rendered_tokens", "/data/tokens.parquet", digest="d" * 64, profile={"dagster/row_count": 12})
        run.log_dataset("chat_dataset", "dagster://chat_dataset", digest="c" * 8, context="eval")
        version = run.register_checkpoint(
            "sft-test", "tinker://run-1/weights/000002", tags={"base_model": "tiny", "training_run": context.run.run_id}
        )
    return dg.MaterializeResult(
        metadata={"mlflow_run": dg.MetadataValue.url(run.url), "model_version": version.version}
    )


@dg.asset
def failing(context: dg.AssetExecutionContext, mlflow: MlflowResource) -> None:
    with mlflow.start_run(context):
        raise RuntimeError("training diverged")


def test_one_tagged_run_per_materialization_with_metrics_datasets_and_model_version(mlflow_resource):
    result = dg.materialize([tracked], partition_key="ckpt-b", resources={"mlflow": mlflow_resource})
    assert result.success
    client = mlflow_resource.get_client()
    runs = client.search_runs([mlflow_resource.experiment_id(client)])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == RunStatus.to_string(RunStatus.FINISHED)
    assert run.data.tags[TAG_DAGSTER_RUN_ID] == result.run_id
    assert run.data.tags[TAG_ASSET_KEY] == "tracked"
    assert run.data.tags[TAG_PARTITION] == "ckpt-b"
    assert run.data.params == {"learning_rate": "0.001", "batch_size": "4"}
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [3.0, 2.0, 1.0]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss_sum")] == [0, 1, 2]
    assert "note" not in run.data.metrics
    tokens_input, chat_input = sorted(run.inputs.dataset_inputs, key=lambda i: i.dataset.name != "rendered_tokens")
    assert tokens_input.dataset.name == "rendered_tokens"
    assert tokens_input.dataset.digest == "d" * 36
    assert tokens_input.dataset.source_type == "local"
    assert json.loads(tokens_input.dataset.source) == {"uri": "/data/tokens.parquet"}
    assert json.loads(tokens_input.dataset.profile) == {"dagster/row_count": 12}
    assert {t.key: t.value for t in tokens_input.tags} == {"mlflow.data.context": "training", "dagster.data_version": "d" * 64}
    assert (chat_input.dataset.name, chat_input.dataset.source_type) == ("chat_dataset", "http")
    assert json.loads(chat_input.dataset.source) == {"url": "dagster://chat_dataset"}
    assert chat_input.dataset.profile is None
    assert {t.key: t.value for t in chat_input.tags}["mlflow.data.context"] == "eval"
    (version,) = client.search_model_versions("name='sft-test'")
    assert version.source == "tinker://run-1/weights/000002"
    assert version.run_id == run.info.run_id
    (model,) = client.search_logged_models([run.info.experiment_id])
    assert version.tags == {
        "base_model": "tiny",
        "training_run": result.run_id,
        "tinker_path": "tinker://run-1/weights/000002",
        "logged_model_id": model.model_id,
    }
    url = result.asset_materializations_for_node("tracked")[0].metadata["mlflow_run"].value
    assert url.endswith(f"/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}")


def test_a_failing_step_marks_its_mlflow_run_failed(mlflow_resource):
    result = dg.materialize([failing], resources={"mlflow": mlflow_resource}, raise_on_error=False)
    assert not result.success
    client = mlflow_resource.get_client()
    (run,) = client.search_runs([mlflow_resource.experiment_id(client)])
    assert run.info.status == RunStatus.to_string(RunStatus.FAILED)
    assert TAG_PARTITION not in run.data.tags


def test_secret_looking_params_are_refused(mlflow_resource):
    @dg.asset
    def leaky(context: dg.AssetExecutionContext, mlflow: MlflowResource) -> None:
        with mlflow.start_run(context) as run:
            with pytest.raises(ValueError, match="TINKER_API_KEY|api_key"):
                run.log_params({"lr": 1, "tinker_api_key": "tml-secret"})

    assert dg.materialize([leaky], resources={"mlflow": mlflow_resource}).success
    client = mlflow_resource.get_client()
    (run,) = client.search_runs([mlflow_resource.experiment_id(client)])
    assert run.data.params == {}


def test_secret_looking_run_tags_are_refused_before_the_run_opens(mlflow_resource):
    @dg.asset
    def leaky_tags(context: dg.AssetExecutionContext, mlflow: MlflowResource) -> None:
        with pytest.raises(ValueError, match=r"start_run\(tags=\).*\['hf_token'\]"):
            with mlflow.start_run(context, tags={"hf_token": "hf_secret"}):
                pass

    assert dg.materialize([leaky_tags], resources={"mlflow": mlflow_resource}).success
    client = mlflow_resource.get_client()
    assert client.search_runs([mlflow_resource.experiment_id(client)]) == []


def test_default_store_is_sqlite_at_an_absolute_path_under_the_state_dir(project_state):
    uri = MlflowResource().resolved_tracking_uri()
    assert uri == f"sqlite:///{project_state.resolve() / 'mlflow' / 'mlflow.db'}"
    assert uri.startswith("sqlite:////")


def test_a_resumed_run_logs_each_metric_step_once(mlflow_resource):
    """A kill after committing steps 2-3 but before recording their checkpoint: the resume redoes them."""

    @dg.asset
    def resumed(context: dg.AssetExecutionContext, mlflow: MlflowResource) -> None:
        with mlflow.start_run(context) as run:
            for step in range(4):  # the killed attempt: steps 0..3 committed, checkpoint at 2 recorded
                run.log_metrics({"loss": 4.0 - step, "step_time_seconds": 1.0}, step=step)
            run.truncate_from(2)  # what the core calls when it resumes at step 2
            for step in range(2, 6):
                run.log_metrics({"loss": 4.0 - step, "step_time_seconds": 2.0}, step=step)

    assert dg.materialize([resumed], resources={"mlflow": mlflow_resource}).success
    client = mlflow_resource.get_client()
    (run,) = client.search_runs([mlflow_resource.experiment_id(client)])
    for name in ("loss", "step_time_seconds"):
        assert sorted(point.step for point in client.get_metric_history(run.info.run_id, name)) == list(range(6))
    assert [p.value for p in sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda p: p.step)] == [4.0, 3.0, 2.0, 1.0, 0.0, -1.0]


def test_a_resume_tag_continues_its_run_even_after_it_finished(mlflow_resource):
    """A kill after the training asset marked its MLflow run FINISHED but before Dagster recorded the step's
    success: the re-execution resumes the same log dir, so it must continue that run, not open a second one."""

    def attempt(log_dir: str, step: int):
        @dg.asset(name="training")
        def training(context: dg.AssetExecutionContext, mlflow: MlflowResource) -> None:
            tag = ("posttrain.log_dir", log_dir)
            with mlflow.start_run(context, tags=dict([tag]), resume_tag=tag) as run:
                run.log_metrics({"loss": float(step)}, step=step)

        return dg.materialize([training], resources={"mlflow": mlflow_resource}).success

    assert attempt("/runs/a", 0) and attempt("/runs/a", 1) and attempt("/runs/b", 0)
    client = mlflow_resource.get_client()
    runs = client.search_runs([mlflow_resource.experiment_id(client)], "tags.`posttrain.log_dir` = '/runs/a'")
    assert len(runs) == 1 and runs[0].info.status == RunStatus.to_string(RunStatus.FINISHED)
    assert sorted(p.step for p in client.get_metric_history(runs[0].info.run_id, "loss")) == [0, 1]
    assert len(client.search_runs([mlflow_resource.experiment_id(client)], "tags.`posttrain.log_dir` = '/runs/b'")) == 1
