"""SIGKILL a training subprocess (the plain CLI) mid-run, run it again, and check nothing repeats or is lost."""

import json
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
from posttrain.supervised.train import run
from tests.posttrain.supervised.tiny_data import TINY_MODEL, arithmetic_table, tiny_tokenizer

REPO = Path(__file__).resolve().parents[3]


def _run_id(tinker_path: str) -> str:
    return tinker_path.removeprefix("tinker://").split("/")[0]


def test_cli_resumes_after_sigkill_without_repeated_or_missing_steps(tinker_server, tmp_path, monkeypatch):
    data_path = tmp_path / "tokens.parquet"
    pq.write_table(arithmetic_table(tiny_tokenizer(), 20), data_path)
    log_dir = tmp_path / "run"
    config = {
        "train_data": str(data_path), "base_url": tinker_server.base_url, "base_model": TINY_MODEL,
        "lora_rank": 4, "learning_rate": 1e-2, "batch_size": 2, "num_epochs": 1, "save_every": 2,
        "eval_split": None, "log_dir": str(log_dir),
    }
    command = [sys.executable, "-m", "posttrain.supervised.train", "--config", json.dumps(config)]
    env = {**os.environ, "TINKER_API_KEY": "tml-local", "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}

    victim = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    deadline = time.monotonic() + 60
    while not read_checkpoints(log_dir) and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(victim.pid, signal.SIGKILL)
    _, stderr = victim.communicate(timeout=30)
    assert victim.returncode == -signal.SIGKILL, stderr.decode()[-2000:]
    before = read_checkpoints(log_dir)
    assert before and not before[-1].final, "the kill must land mid-run"

    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    summary = run(dict(config))  # the same entry point, in this process (spares a second interpreter start)

    after = read_checkpoints(log_dir)
    assert [record.batch for record in after] == [2, 4, 6, 8, 10]
    assert [record.final for record in after] == [False] * 4 + [True]
    assert after[: len(before)] == before
    assert summary["start_step"] == before[-1].batch and summary["total_steps"] == 10
    resumed_runs = {_run_id(record.state_path) for record in after[len(before) :]}
    assert resumed_runs and _run_id(before[-1].state_path) not in resumed_runs  # a new client, created from state

    rows = read_metrics(log_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(10))
    assert [row["learning_rate"] for row in rows] == pytest.approx([1e-2 * (1 - step / 10) for step in range(10)])
