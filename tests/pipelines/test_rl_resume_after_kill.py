"""SIGKILL an RL training run mid-training, re-execute from failure: no step lost or repeated, no rollout row duplicated,
and every row's sampler weights (including those of the killed attempt) still load."""

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import tinker

from pipelines.definitions import build_definitions
from posttrain.checkpoints import read_checkpoints
from tests.fixtures.dagster_env import TINY_MODEL, tiny_resources
from tests.pipelines.rl_resume_job import RL_RESUME_STEPS, tiny_rl_train_job

REPO = Path(__file__).resolve().parents[2]
SAMPLES_PER_STEP = 4  # groups_per_batch × group_size


def test_killed_rl_run_resumes_with_every_step_and_rollout_row_exactly_once(dagster_instance, project_state, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_BASE_MODEL", TINY_MODEL)
    data = build_definitions(tiny_resources(project_state)).resolve_job_def("rl_data")
    data_config = {"ops": {"rl_problems": {"config": {"limit": 40, "heldout_fraction": 0.1}}}}
    assert data.execute_in_process(instance=dagster_instance, run_config=data_config).success

    child = subprocess.Popen([sys.executable, "-m", "tests.pipelines.rl_resume_job"], cwd=REPO, env=dict(os.environ),
                             start_new_session=True)
    deadline = time.monotonic() + 300
    training_dir = project_state / "training"
    while not any(training_dir.glob("*/checkpoints.jsonl")):  # the first checkpoint is recorded: kill mid-training
        assert child.poll() is None and time.monotonic() < deadline, "training finished or hung before a checkpoint"
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()

    (killed,) = dagster_instance.get_runs(dg.RunsFilter(job_name="rl_train"))
    log_dir = training_dir / killed.run_id
    killed_at = read_checkpoints(log_dir)[-1].batch
    assert 0 < killed_at < RL_RESUME_STEPS
    dagster_instance.report_run_failed(killed)
    resumed = dg.execute_job(
        dg.reconstructable(tiny_rl_train_job),
        instance=dagster_instance,
        reexecution_options=dg.ReexecutionOptions.from_failure(killed.run_id, dagster_instance),
    )
    assert resumed.success

    assert [r.batch for r in read_checkpoints(log_dir)] == [2, 4, 6]
    rows = pq.read_table(project_state / "parquet" / "rollout_batches.parquet").to_pylist()
    assert Counter(row["step"] for row in rows) == {step: SAMPLES_PER_STEP for step in range(RL_RESUME_STEPS)}
    assert len({(row["step"], row["group"], row["sample"]) for row in rows}) == len(rows)
    assert {row["training_run_id"] for row in rows} == {killed.run_id}

    mlflow = tiny_resources(project_state)["mlflow"]
    client = mlflow.get_client()
    (run,) = client.search_runs([mlflow.experiment_id(client)], f"tags.`posttrain.log_dir` = '{log_dir}'")
    for metric in ("reward/mean", "loss", "accuracy"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, metric)] == list(range(RL_RESUME_STEPS)), metric

    paths = {row["step"]: row["sampler_path"] for row in rows}
    assert len(set(paths.values())) == RL_RESUME_STEPS  # one sampler per step, before and after the kill
    with tiny_resources(project_state)["tinker"].session("load every rollout sampler") as service:
        for step, path in sorted(paths.items()):
            sampler = service.create_sampling_client(model_path=path).result()
            sample = sampler.sample(tinker.ModelInput.from_ints([1, 2, 3]), 1, tinker.SamplingParams(max_tokens=1, seed=step)).result()
            assert len(sample.sequences[0].tokens) == 1, path
