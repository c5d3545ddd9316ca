"""Checkpoints as MLflow 3 logged models + registered-model versions, and the latest/best aliases.

All against one real sqlite MLflow store per module (creating a store costs seconds); every test uses
its own experiment and registered-model names, so tests cannot see each other's entities.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import LoggedModelStatus

from resources.mlflow import (
    ALIAS_BEST,
    ALIAS_LATEST,
    TAG_EVAL_SCORE,
    MlflowResource,
    MlflowRun,
    RegisteredCheckpoint,
)
from tests.fixtures.concurrent_evaluations import race_alias_updates

TOKENS_DIGEST = "t" * 64
LINEAGE = {"base_model": "tiny", "training_run": "dagster-run-1", "dagster.partition": "sft-1a2b3c4d-000002"}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mlflow")


@pytest.fixture
def resource(store: Path) -> MlflowResource:
    return MlflowResource(
        tracking_uri=f"sqlite:///{store / 'mlflow.db'}",
        artifact_root=(store / "artifacts").as_uri(),
        experiment_name=f"exp-{uuid.uuid4().hex[:8]}",
        ui_url="http://mlflow.test",
    )


@pytest.fixture
def model_name() -> str:
    return f"sft-{uuid.uuid4().hex[:8]}"


def open_run(resource: MlflowResource) -> MlflowRun:
    """A training run with a param and a training dataset, as the training asset leaves it before checkpoints."""
    client = resource.get_client()
    experiment_id = resource.experiment_id(client)
    run_id = client.create_run(experiment_id).info.run_id
    run = MlflowRun(client, run_id, experiment_id, resource.run_url(experiment_id, run_id), resource.ui_url)
    run.log_params({"learning_rate": 1e-4})
    run.log_dataset("rendered_tokens", "/data/tokens.parquet", digest=TOKENS_DIGEST)
    run.log_dataset("eval_prompts", "/data/eval.parquet", digest="e" * 64, context="eval")
    return run


def logged_models(run: MlflowRun):
    return run.client.search_logged_models([run.experiment_id])


def test_a_checkpoint_becomes_an_external_logged_model_with_lineage_metrics_and_a_version(resource, model_name):
    run = open_run(resource)
    step_metrics = {"loss": 2.5, "loss:sum": 40.0, "note": "not a number"}
    run.log_metrics(step_metrics, step=2)
    path = "tinker://run-1/weights/000002"

    registered = run.register_checkpoint(
        model_name, path, LINEAGE, step=2, metrics=step_metrics, metrics_dataset="rendered_tokens"
    )

    client = run.client
    (model,) = logged_models(run)
    assert registered == RegisteredCheckpoint(
        model_name=model_name,
        version=1,
        model_id=model.model_id,
        model_version_url=f"http://mlflow.test/#/models/{model_name}/versions/1",
        logged_model_url=f"http://mlflow.test/#/experiments/{run.experiment_id}/models/{model.model_id}",
    )
    assert model.model_type == "tinker-lora"
    assert model.status == LoggedModelStatus.READY
    assert model.source_run_id == run.run_id
    assert {**LINEAGE, "tinker_path": path, "step": "2", "mlflow.model.isExternal": "true"}.items() <= model.tags.items()
    assert json.loads(model.tags["mlflow.modelVersions"]) == [{"name": model_name, "version": 1}]
    assert model.params == {"learning_rate": "0.0001", "tinker_path": path, "step": "2"}
    # metrics on the model page, at the step, linked to the dataset they were measured on
    assert {(m.key, m.value, m.step, m.dataset_name, m.dataset_digest) for m in model.metrics} == {
        ("loss", 2.5, 2, "rendered_tokens", TOKENS_DIGEST[:36]),
        ("loss_sum", 40.0, 2, "rendered_tokens", TOKENS_DIGEST[:36]),
    }
    # ...without a second point in the run's own history for that step
    assert [(m.step, m.value) for m in client.get_metric_history(run.run_id, "loss")] == [(2, 2.5)]
    assert [(o.model_id, o.step) for o in client.get_run(run.run_id).outputs.model_outputs] == [(model.model_id, 2)]
    assert (Path(model.artifact_location.removeprefix("file://")) / "MLmodel").is_file()

    version = client.get_model_version(model_name, "1")
    assert version.source == path
    assert version.run_id == run.run_id
    assert version.tags == {**LINEAGE, "tinker_path": path, "step": "2", "logged_model_id": model.model_id}


def test_registering_again_returns_the_same_model_and_version_and_writes_nothing_new(resource, model_name):
    run = open_run(resource)
    path = "tinker://run-1/weights/000004"
    first = run.register_checkpoint(model_name, path, LINEAGE, step=4, metrics={"loss": 1.0})
    again = run.register_checkpoint(model_name, path, LINEAGE, step=4, metrics={"loss": 1.0})

    assert again == first
    (model,) = logged_models(run)
    assert [(m.key, m.value) for m in model.metrics] == [("loss", 1.0)]
    assert len(run.client.search_model_versions(f"name = '{model_name}'")) == 1
    assert len(run.client.get_run(run.run_id).outputs.model_outputs) == 1
    assert json.loads(model.tags["mlflow.modelVersions"]) == [{"name": model_name, "version": 1}]


def test_a_crash_before_the_version_is_created_is_completed_by_the_retry_on_the_same_logged_model(
    resource, model_name, monkeypatch
):
    run = open_run(resource)
    path = "tinker://run-2/weights/000006"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed between the logged model and the model version")

    with monkeypatch.context() as patch:
        patch.setattr(run.client, "create_model_version", killed)
        with pytest.raises(KeyboardInterrupt):
            run.register_checkpoint(model_name, path, LINEAGE, step=6, metrics={"loss": 0.5})
    (half_registered,) = logged_models(run)
    assert run.client.search_model_versions(f"name = '{model_name}'") == []

    registered = run.register_checkpoint(model_name, path, LINEAGE, step=6, metrics={"loss": 0.5})

    (model,) = logged_models(run)
    assert model.model_id == half_registered.model_id == registered.model_id
    (version,) = run.client.search_model_versions(f"name = '{model_name}'")
    assert version.tags["logged_model_id"] == model.model_id
    assert [(m.key, m.value) for m in model.metrics] == [("loss", 0.5)]


def test_a_crash_before_the_logged_model_is_finalized_is_finalized_by_the_retry(resource, model_name, monkeypatch):
    run = open_run(resource)
    path = "tinker://run-3/weights/000001"
    with monkeypatch.context() as patch:
        patch.setattr(run.client, "finalize_logged_model", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            run.register_checkpoint(model_name, path, LINEAGE, step=1)
    assert logged_models(run)[0].status == LoggedModelStatus.PENDING

    run.register_checkpoint(model_name, path, LINEAGE, step=1)

    (model,) = logged_models(run)
    assert model.status == LoggedModelStatus.READY


def test_each_checkpoint_is_its_own_logged_model_and_the_next_version(resource, model_name):
    run = open_run(resource)
    versions = [
        run.register_checkpoint(model_name, f"tinker://run-4/weights/{step:06d}", LINEAGE, step=step) for step in (10, 20)
    ]
    assert [v.version for v in versions] == [1, 2]
    assert len({v.model_id for v in versions}) == 2
    assert sorted(m.tags["step"] for m in logged_models(run)) == ["10", "20"]


def test_the_positional_call_without_step_still_registers_a_version(resource, model_name):
    run = open_run(resource)
    registered = run.register_checkpoint(model_name, "tinker://run-5/weights/final", {"base_model": "tiny"})
    assert registered.name == model_name and registered.version == 1
    (model,) = logged_models(run)
    assert model.name == f"{model_name}-final"
    assert "step" not in model.tags
    assert run.model_version_url(registered) == registered.model_version_url


def test_bad_inputs_are_refused_with_the_place_and_the_fix(resource, model_name):
    run = open_run(resource)
    with pytest.raises(ValueError, match="tinker:// path.*state_path"):
        run.register_checkpoint(model_name, "", LINEAGE, step=1)
    with pytest.raises(ValueError, match=r"\['tinker_api_key'\].*secrets"):
        run.register_checkpoint(model_name, "tinker://r/weights/1", {"tinker_api_key": "tml-x"}, step=1)
    with pytest.raises(ValueError, match="need the step.*step="):
        run.register_checkpoint(model_name, "tinker://r/weights/1", LINEAGE, metrics={"loss": 1.0})
    with pytest.raises(ValueError, match=r"metrics_dataset='chat' was not logged.*eval_prompts.*log_dataset"):
        run.register_checkpoint(model_name, "tinker://r/weights/1", LINEAGE, step=1, metrics={"loss": 1.0}, metrics_dataset="chat")
    with pytest.raises(ValueError, match="MlflowRun.set_tags.*HF_TOKEN"):
        run.set_tags({"HF_TOKEN": "hf_x"})
    assert "HF_TOKEN" not in run.client.get_run(run.run_id).data.tags
    assert logged_models(run) == []  # a refused call leaves nothing half-registered


def register_versions(resource: MlflowResource, model_name: str, count: int) -> None:
    run = open_run(resource)
    for step in range(1, count + 1):
        tags = {**LINEAGE, "dagster.partition": f"sft-run-{step:06d}"}
        run.register_checkpoint(model_name, f"tinker://alias/weights/{model_name}-{step}", tags, step=step)


def test_latest_and_best_follow_the_evaluations(resource, model_name):
    register_versions(resource, model_name, 4)
    assert resource.update_aliases(model_name, 1, 0.5) == {ALIAS_LATEST: 1, ALIAS_BEST: 1}
    assert resource.update_aliases(model_name, 2, 0.3) == {ALIAS_LATEST: 2, ALIAS_BEST: 1}
    assert resource.update_aliases(model_name, "3", 0.7) == {ALIAS_LATEST: 3, ALIAS_BEST: 3}
    assert resource.update_aliases(model_name, 4, None) == {ALIAS_LATEST: 4, ALIAS_BEST: 3}

    assert int(resource.resolve_alias(model_name, ALIAS_BEST).version) == 3
    assert int(resource.resolve_alias(model_name, ALIAS_LATEST).version) == 4
    assert resource.resolve_alias(model_name, ALIAS_BEST).tags[TAG_EVAL_SCORE] == "0.7"
    assert resource.alias_partition(model_name, ALIAS_BEST) == "sft-run-000003"


def test_an_older_version_evaluated_last_does_not_take_latest_and_lower_can_be_better(resource, model_name):
    register_versions(resource, model_name, 2)
    assert resource.update_aliases(model_name, 2, 1.8, higher_is_better=False) == {ALIAS_LATEST: 2, ALIAS_BEST: 2}
    assert resource.update_aliases(model_name, 1, 1.2, higher_is_better=False) == {ALIAS_LATEST: 2, ALIAS_BEST: 1}


def test_scores_recorded_by_another_process_take_part_in_the_comparison(resource, model_name):
    register_versions(resource, model_name, 2)
    resource.update_aliases(model_name, 1, 0.9)
    # another process: a client of its own on the same store, no state shared with `resource`
    other = MlflowClient(tracking_uri=resource.resolved_tracking_uri(), registry_uri=resource.resolved_tracking_uri())
    assert other.get_model_version(model_name, "1").tags[TAG_EVAL_SCORE] == "0.9"
    assert resource.model_copy().update_aliases(model_name, 2, 0.4) == {ALIAS_LATEST: 2, ALIAS_BEST: 1}
    assert other.get_registered_model(model_name).aliases == {ALIAS_LATEST: 2, ALIAS_BEST: 1}


def test_missing_aliases_and_models_are_named_in_the_error(resource, model_name):
    register_versions(resource, model_name, 1)
    with pytest.raises(LookupError, match=rf"{model_name}.*no alias 'best'.*existing aliases: none"):
        resource.resolve_alias(model_name, ALIAS_BEST)
    resource.update_aliases(model_name, 1, None)
    with pytest.raises(LookupError, match=r"no alias 'best' \(existing aliases: latest-evaluated → v1\)"):
        resource.resolve_alias(model_name, ALIAS_BEST)
    with pytest.raises(LookupError, match="no registered model 'nope-.*train that recipe"):
        resource.resolve_alias(f"nope-{model_name}", ALIAS_LATEST)
    with pytest.raises(ValueError, match="score is NaN"):
        resource.update_aliases(model_name, 1, float("nan"))



def test_evaluations_finishing_together_all_succeed_and_leave_the_aliases_every_score_implies(store):
    # four processes per model, released at once: first-time alias inserts collide on the store's unique key
    race = race_alias_updates(f"sqlite:///{store / 'race.db'}")
    assert race.errors == []
    assert race.aliases == [race.implied_aliases] * len(race.aliases)


def test_best_can_follow_a_benchmark_instead_of_the_eval_score(resource, model_name):
    register_versions(resource, model_name, 3)
    follows = resource.model_copy(update={"best_follows": "gsm8k"})
    resource.update_aliases(model_name, 1, 0.9)  # held-out eval score: v1 would be best
    assert follows.record_benchmark(model_name, 2, "gsm8k", 0.40, 0.05, 100) == {ALIAS_LATEST: 2, ALIAS_BEST: 2}
    assert follows.record_benchmark(model_name, 3, "gsm8k", 0.30, 0.05, 100) == {ALIAS_LATEST: 3, ALIAS_BEST: 2}
    assert follows.update_aliases(model_name, 1, 0.95) == {ALIAS_LATEST: 3, ALIAS_BEST: 2}  # evals no longer move best
    tags = resource.get_client().get_model_version(model_name, "3").tags
    assert (tags["benchmark.gsm8k"], tags["benchmark.gsm8k.stderr"], tags["benchmark.gsm8k.n"]) == ("0.3", "0.05", "100")
    # without best_follows, a benchmark only tags the version
    assert resource.record_benchmark(model_name, 1, "mmlu", 0.5, 0.1, 10) == {}
    assert int(resource.get_client().get_registered_model(model_name).aliases[ALIAS_BEST]) == 2
