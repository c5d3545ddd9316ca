"""SIGKILL an RLHF training run mid-training, re-execute from failure: no step lost or repeated, no rollout row
(with its pairwise scores) duplicated."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from pipelines.definitions import build_definitions
from posttrain.checkpoints import read_checkpoints
from tests.fixtures.dagster_env import TINY_MODEL, tiny_resources
from tests.pipelines.rlhf_resume_job import RLHF_RESUME_STEPS, tiny_rlhf_train_job

REPO = Path(__file__).resolve().parents[2]
SAMPLES_PER_STEP = 4  # groups_per_batch × group_size


def train_a_preference_model(defs: dg.Definitions, instance: dg.DagsterInstance, state: Path, tmp_path: Path) -> None:
    """rl_problems for the prompts, and a one-step preference model (from the base model) on a local comparisons file."""
    assert defs.resolve_job_def("rlhf_data").execute_in_process(
        instance=instance, run_config={"ops": {"rl_problems": {"config": {"limit": 40, "heldout_fraction": 0.1}}}}).success
    path = tmp_path / "comparisons.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "chosen": f"{i + 1}", "rejected": f"{i + 7}?"}) + "\n" for i in range(8)))
    comparisons = next(a for a in defs.assets if getattr(a, "key", None) == dg.AssetKey("preference_comparisons"))
    columns = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
    assert dg.materialize([comparisons], instance=instance, resources=tiny_resources(state),
                          run_config={"ops": {"preference_comparisons": {"config": {"source": str(path), "columns": columns}}}}).success
    config = {"comparisons": "preference_comparisons", "init_from": "", "batch_size": 4, "max_steps": 1, "save_every": 0, "lora_rank": 4}
    assert defs.resolve_job_def("preference_model_train").execute_in_process(
        instance=instance, run_config={"ops": {"preference_model_checkpoint": {"config": config}}}).success


@pytest.mark.slow
def test_killed_rlhf_run_resumes_with_every_step_and_rollout_row_exactly_once(dagster_instance, project_state, monkeypatch, tmp_path):
    monkeypatch.setenv("POSTTRAIN_BASE_MODEL", TINY_MODEL)
    train_a_preference_model(build_definitions(tiny_resources(project_state)), dagster_instance, project_state, tmp_path)

    child = subprocess.Popen([sys.executable, "-m", "tests.pipelines.rlhf_resume_job"], cwd=REPO, env=dict(os.environ),
                             start_new_session=True)
    deadline = time.monotonic() + 300
    (judge_run,) = dagster_instance.get_runs(dg.RunsFilter(job_name="preference_model_train"))
    training_dir = project_state / "training"
    while not [p for p in training_dir.glob("*/checkpoints.jsonl") if p.parent.name != judge_run.run_id]:
        assert child.poll() is None and time.monotonic() < deadline, "training finished or hung before a checkpoint"
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()

    (killed,) = dagster_instance.get_runs(dg.RunsFilter(job_name="rlhf_train"))
    log_dir = training_dir / killed.run_id
    killed_at = read_checkpoints(log_dir)[-1].batch
    assert 0 < killed_at < RLHF_RESUME_STEPS
    dagster_instance.report_run_failed(killed)
    resumed = dg.execute_job(
        dg.reconstructable(tiny_rlhf_train_job),
        instance=dagster_instance,
        reexecution_options=dg.ReexecutionOptions.from_failure(killed.run_id, dagster_instance),
    )
    assert resumed.success

    assert [r.batch for r in read_checkpoints(log_dir)] == [2, 4, 6]
    rows = pq.read_table(project_state / "parquet" / "rlhf_rollout_batches.parquet").to_pylist()
    assert Counter(row["step"] for row in rows) == {step: SAMPLES_PER_STEP for step in range(RLHF_RESUME_STEPS)}
    assert len({(row["step"], row["group"], row["sample"]) for row in rows}) == len(rows)
    assert all(len(json.loads(row["pairwise_scores"])) == 1 for row in rows)  # a group of 2: one opponent each

    mlflow = tiny_resources(project_state)["mlflow"]
    client = mlflow.get_client()
    (run,) = client.search_runs([mlflow.experiment_id(client)], f"tags.`posttrain.log_dir` = '{log_dir}'")
    for metric in ("reward/mean", "loss", "env/win_fraction"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, metric)] == list(range(RLHF_RESUME_STEPS)), metric
