"""The production profile (deploy/postgres) against a real PostgreSQL, a real daemon and a real code server.

Three training runs are queued at once; the `tinker` pool (limit 1 in the profile) must run them one after
another while the automation sensor, ticked by the daemon, evaluates each new checkpoint; Dagster's storage and
MLflow's tracking store are both in PostgreSQL. Minutes of CPU: marked ``postgres`` (``make test-postgres``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
from mlflow import MlflowClient

from tests.fixtures.concurrent_evaluations import race_alias_updates
from tests.fixtures.dagster_env import TINY_CHAIN_CONFIG, TINY_MODEL
from tests.scaleout.deployment import POOL, POOL_LIMIT, Deployment, running_deployment, wait_until
from tests.scaleout.postgres_cluster import PostgresCluster

pytestmark = pytest.mark.postgres

TRAINING_ASSET = "sft_checkpoint"
TEST_TAG = "posttrain/scaleout-test"
TRAINING_JOBS = ("sft_chain", "sft_train", "sft_train")  # the chain first: it materializes the data the others read
TERMINAL = {dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}


@pytest.fixture(scope="module")
def deployment(postgres: PostgresCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with running_deployment(postgres, tmp_path_factory.mktemp("scaleout"), TINY_MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def instance(deployment: Deployment) -> Iterator[dg.DagsterInstance]:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in deployment.env.items():
            if name.startswith("DAGSTER_PG_") or name == "DAGSTER_HOME":
                patch.setenv(name, value)
        with dg.DagsterInstance.from_config(str(deployment.dagster_home)) as loaded:
            yield loaded


def _training_config(job: str) -> dict:
    """The tiny chain of the SFT tests, one checkpoint per run (the final one) to keep evals to three."""
    config = copy.deepcopy(TINY_CHAIN_CONFIG)
    config["ops"][TRAINING_ASSET]["config"].update(save_every=0, max_steps=4)
    return config if job == "sft_chain" else {"ops": {TRAINING_ASSET: config["ops"][TRAINING_ASSET]}}


def _records(instance: dg.DagsterInstance, **filters) -> list[dg.RunRecord]:
    return list(instance.get_run_records(filters=dg.RunsFilter(**filters)))


def _failure_report(instance: dg.DagsterInstance, deployment: Deployment, records: list[dg.RunRecord]) -> str:
    lines = []
    for record in records:
        run = record.dagster_run
        if run.status == dg.DagsterRunStatus.FAILURE:
            errors = [
                str(event.dagster_event.event_specific_data)[:1500]
                for event in instance.all_logs(run.run_id)
                if event.dagster_event and event.dagster_event.is_failure
            ]
            lines.append(f"{run.job_name} {run.run_id}: {errors}")
    return "\n".join(lines) + "\n--- daemon\n" + deployment.log_tail("daemon") + "\n--- code server\n" + deployment.log_tail("code_server")


def test_profile_puts_runs_events_and_schedules_in_postgres_and_queues_runs(instance: dg.DagsterInstance) -> None:
    assert type(instance.run_storage).__name__ == "PostgresRunStorage"
    assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
    assert type(instance.schedule_storage).__name__ == "PostgresScheduleStorage"
    assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
    pools = instance.get_concurrency_config().pool_config
    assert pools.pool_granularity.value == "run" and pools.default_pool_limit == 1


def test_training_asset_declares_the_tinker_pool() -> None:
    from pipelines.definitions import defs

    pool = defs.resolve_assets_def(TRAINING_ASSET).op.pool
    assert pool == POOL, f"{TRAINING_ASSET} runs in pool {pool!r}: add `pool={POOL!r}` to its @dg.asset decorator"


@pytest.mark.timeout(2700)
def test_tinker_pool_serialises_training_runs_while_automation_evaluates_each_checkpoint(
    deployment: Deployment, instance: dg.DagsterInstance, tmp_path: Path
) -> None:
    for index, job in enumerate(TRAINING_JOBS):
        deployment.launch(job, _training_config(job), {TEST_TAG: str(index)})

    training = lambda: _records(instance, tags={TEST_TAG: [str(i) for i in range(len(TRAINING_JOBS))]})  # noqa: E731
    wait_until(
        # >=: a failed run retried by the daemon is one more record; the assertion below then reports the failure
        lambda: len(training()) >= len(TRAINING_JOBS) and all(r.dagster_run.status in TERMINAL for r in training()),
        1500,
        lambda: f"training runs {[(r.dagster_run.job_name, r.dagster_run.status.value) for r in training()]}\n"
        + deployment.log_tail("daemon"),
        every_s=5,
    )
    runs = sorted(training(), key=lambda r: r.start_time or 0)
    assert all(r.dagster_run.status == dg.DagsterRunStatus.SUCCESS for r in runs), _failure_report(instance, deployment, runs)

    partitions = instance.get_dynamic_partitions("sft_checkpoints")
    assert len(partitions) == len(TRAINING_JOBS), partitions
    evals = lambda: _records(instance, tags={"dagster/from_automation_condition": "true"})  # noqa: E731
    wait_until(
        lambda: {r.dagster_run.tags.get("dagster/partition") for r in evals() if r.dagster_run.status in TERMINAL} >= set(partitions),
        900,
        lambda: f"automation-launched evals of {partitions}: {[(r.dagster_run.tags.get('dagster/partition'), r.dagster_run.status.value) for r in evals()]}",
        every_s=5,
    )
    eval_records = evals()
    timeline = [
        {
            "job": r.dagster_run.job_name,
            "run_id": r.dagster_run.run_id,
            "partition": r.dagster_run.tags.get("dagster/partition"),
            "status": r.dagster_run.status.value,
            "created": r.create_timestamp.timestamp(),
            "started": r.start_time,
            "ended": r.end_time,
        }
        for r in sorted(runs + eval_records, key=lambda r: r.start_time or 0)
    ]
    (tmp_path / "timeline.json").write_text(json.dumps(timeline, indent=2))
    origin = min(row["created"] for row in timeline)
    since = lambda moment: "    —  " if moment is None else f"{moment - origin:7.1f}"  # noqa: E731 - a retry may not have started
    for row in timeline:
        print(
            f"{row['job']:>10} {row['partition'] or '':<22} queued {since(row['created'])} s  "
            f"ran {since(row['started'])} → {since(row['ended'])} s  {row['status']}"
        )

    # The pool: training runs never overlapped, and the later ones were enqueued while an earlier one ran.
    for earlier, later in zip(runs, runs[1:]):
        assert later.start_time >= earlier.end_time, f"{later.dagster_run.run_id} started while {earlier.dagster_run.run_id} ran"
    assert all(r.create_timestamp.timestamp() < runs[0].end_time for r in runs), "runs were not queued together"
    assert instance.event_log_storage.get_concurrency_info(POOL).slot_count == POOL_LIMIT

    # Evaluations: launched by the daemon's automation sensor, one per checkpoint, materialized in the Postgres event log.
    assert all(r.dagster_run.status == dg.DagsterRunStatus.SUCCESS for r in eval_records), _failure_report(
        instance, deployment, eval_records
    )
    assert sorted(r.dagster_run.tags.get("dagster/partition") for r in eval_records) == sorted(partitions)  # each once
    assert instance.get_materialized_partitions(dg.AssetKey("sft_eval_report")) >= set(partitions)

    # MLflow's store is the same PostgreSQL: every training and eval run logged there, tagged with its Dagster run.
    client = MlflowClient(tracking_uri=deployment.mlflow_tracking_uri)
    experiment = client.get_experiment_by_name("posttrain")
    logged = {run.data.tags.get("dagster.run_id") for run in client.search_runs([experiment.experiment_id], max_results=100)}
    assert {r.dagster_run.run_id for r in runs + eval_records} <= logged


def test_evaluations_finishing_together_on_postgres_all_succeed(postgres: PostgresCluster) -> None:
    # the failure CI once hit: two eval runs' first `latest-evaluated` inserts collided on the alias key
    postgres.create_database("alias_race")
    race = race_alias_updates(postgres.url("alias_race"))
    assert race.errors == []
    assert race.aliases == [race.implied_aliases] * len(race.aliases)
