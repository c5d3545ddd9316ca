"""DPO through the training core (``posttrain.training.core.train``) via the plain CLI, including
exact resume after SIGKILL, on the real SDK and the tiny-random localtinker server."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from posttrain.checkpoints import read_checkpoints
from posttrain.metrics import read_metrics
from posttrain.preference.recipe import REFERENCE_FILE
from posttrain.preference.train import run
from tests.posttrain.preference.tiny_pairs import TINY_MODEL, pairs_table

REPO = Path(__file__).resolve().parents[3]


def _config(tinker_server, tmp_path, data_path, **training) -> dict:
    return {
        "train_data": str(data_path), "base_url": tinker_server.base_url,
        "beta": 0.5, "batch_size": 2, "num_epochs": 2,
        "training": {"base_model": TINY_MODEL, "lora_rank": 4, "learning_rate": 5e-3, "log_dir": str(tmp_path / "run"), **training},
    }


def test_cli_trains_and_reports_heldout_pair_accuracy(tinker_server, tmp_path, monkeypatch):
    data_path = tmp_path / "pairs.parquet"
    pq.write_table(pairs_table(10, heldout_every=5), data_path)  # 8 train, 2 held out
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    summary = run(_config(tinker_server, tmp_path, data_path, eval_every=4))
    assert summary["total_steps"] == 8 and summary["start_step"] == 0
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(8))
    assert rows[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert rows[-1]["dpo_loss"] < rows[0]["dpo_loss"]
    assert rows[3]["eval/num_pairs"] == 2.0 and 0.0 <= rows[3]["eval/pair_accuracy"] <= 1.0
    assert summary["final_metrics"]["eval/margin"] > 0  # the held-out pairs share the training pairs' pattern
    reference = pq.read_table(tmp_path / "run" / REFERENCE_FILE)
    assert sorted(reference.column("row_id").to_pylist()) == sorted(f"pair{i}" for i in range(10))


def test_cli_resumes_after_sigkill_without_repeated_or_missing_steps(tinker_server, tmp_path, monkeypatch):
    data_path = tmp_path / "pairs.parquet"
    pq.write_table(pairs_table(10), data_path)
    log_dir = tmp_path / "run"
    config = _config(tinker_server, tmp_path, data_path, save_every=2)
    config["num_epochs"] = 2
    command = [sys.executable, "-m", "posttrain.preference.train", "--config", json.dumps(config)]
    env = {**os.environ, "TINKER_API_KEY": "tml-local", "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}
    victim = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 120
    while not read_checkpoints(log_dir) and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(victim.pid, signal.SIGKILL)
    _, stderr = victim.communicate(timeout=30)
    assert victim.returncode == -signal.SIGKILL, stderr.decode()[-2000:]
    before = read_checkpoints(log_dir)
    assert before and not before[-1].final, "the kill must land mid-run"
    reference_before = pq.read_table(log_dir / REFERENCE_FILE)

    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    summary = run(json.loads(json.dumps(config)))

    after = read_checkpoints(log_dir)
    assert [record.batch for record in after] == [2, 4, 6, 8, 10]
    assert [record.final for record in after] == [False] * 4 + [True]
    assert after[: len(before)] == before
    assert summary["start_step"] == before[-1].batch
    assert pq.read_table(log_dir / REFERENCE_FILE).equals(reference_before)  # read back, not re-snapshotted
    rows = read_metrics(log_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(10))
    assert [row["epoch"] for row in rows] == [0.0] * 5 + [1.0] * 5
    assert rows[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-4)


def test_resume_with_another_beta_is_refused(tinker_server, tmp_path, monkeypatch):
    data_path = tmp_path / "pairs.parquet"
    pq.write_table(pairs_table(4), data_path)
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    config = _config(tinker_server, tmp_path, data_path, save_every=1, max_steps=2)
    run(json.loads(json.dumps(config)))
    config["beta"] = 0.25
    with pytest.raises(ValueError, match=r"beta.*0\.5"):
        run(config)
