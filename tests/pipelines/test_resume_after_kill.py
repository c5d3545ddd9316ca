"""SIGKILL the training run's processes mid-training, re-execute from failure: no step lost or repeated."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg

from assets.checkpoint_manifest import all_manifests
from pipelines.definitions import build_definitions
from posttrain.checkpoints import read_checkpoints
from tests.fixtures.dagster_env import TINY_CHAIN_CONFIG, TINY_MODEL, tiny_resources
from tests.pipelines.resume_job import tiny_train_job

REPO = Path(__file__).resolve().parents[2]


def test_killed_training_resumes_from_its_last_checkpoint_with_one_mlflow_history(dagster_instance, project_state, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_BASE_MODEL", TINY_MODEL)
    # 80 rows: the training side (~60 after the held-out quarter) covers all 8 steps of 4 in one epoch
    data_config = {"ops": {"chat_dataset": {"config": {**TINY_CHAIN_CONFIG["ops"]["chat_dataset"]["config"], "limit": 80}}}}
    data = build_definitions(tiny_resources(project_state)).resolve_job_def("sft_data")
    assert data.execute_in_process(instance=dagster_instance, run_config=data_config).success

    child = subprocess.Popen(
        [sys.executable, "-m", "tests.pipelines.resume_job"], cwd=REPO, env=dict(os.environ), start_new_session=True
    )
    deadline = time.monotonic() + 300
    while not all_manifests():  # the first checkpoint is registered: kill in the middle of training
        assert child.poll() is None and time.monotonic() < deadline, "training finished or hung before a checkpoint"
        time.sleep(0.2)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()

    (killed,) = dagster_instance.get_runs(dg.RunsFilter(job_name="sft_train"))
    assert killed.status == dg.DagsterRunStatus.STARTED  # nobody told Dagster: the process just died
    dagster_instance.report_run_failed(killed)  # what run monitoring does when the daemon runs
    resumed = dg.execute_job(
        dg.reconstructable(tiny_train_job),
        instance=dagster_instance,
        reexecution_options=dg.ReexecutionOptions.from_failure(killed.run_id, dagster_instance),
    )
    assert resumed.success

    log_dir = project_state / "training" / killed.run_id
    records = read_checkpoints(log_dir)
    assert [r.batch for r in records] == [2, 4, 6, 8]
    manifests = sorted(all_manifests(), key=lambda m: m.step)
    assert [m.state_path for m in manifests] == [r.state_path for r in records]
    assert sorted(dagster_instance.get_dynamic_partitions("sft_checkpoints")) == sorted(m.partition for m in manifests)

    mlflow = tiny_resources(project_state)["mlflow"]
    client = mlflow.get_client()
    (run,) = client.search_runs([mlflow.experiment_id(client)], f"tags.`posttrain.log_dir` = '{log_dir}'")
    assert run.info.status == "FINISHED"
    assert run.data.tags["dagster.run_id"] == resumed.run_id
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(8))
    versions = client.search_model_versions("name='sft'")
    assert sorted(v.source for v in versions) == sorted(r.state_path for r in records)
