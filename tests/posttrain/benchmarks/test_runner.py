"""One benchmark run end to end: provider -> localtinker -> inspect log -> result; failures leave nothing."""

from __future__ import annotations

import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
from posttrain.benchmarks.results import BenchmarkResult, BenchmarkRunError
from posttrain.benchmarks.runner import run_benchmark
from tests.fixtures.server import TINY_MODEL

SECRET_KEY = "tml-secret-never-logged-4242"


@pytest.mark.slow
def test_a_checkpoint_is_benchmarked_and_its_log_kept(benchmark_mirror: Path, tiny_target, service_client, tmp_path: Path) -> None:
    training = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4).result()
    sampler_path = training.save_weights_for_sampler("bench-ckpt").result().path
    target = replace(tiny_target, model=sampler_path, api_key=SECRET_KEY)

    result = run_benchmark("gsm8k", target, tmp_path / "logs", limit=3, task_args={"max_tokens": 8})

    assert isinstance(result, BenchmarkResult)
    summary = result.summary()
    assert (summary["task"], summary["metric"], summary["n"]) == ("gsm8k", "accuracy", 3)
    assert summary["model"] == f"tinker/{sampler_path}"
    assert 0.0 <= summary["value"] <= 1.0
    assert [row["sample_id"] for row in result.samples] and all(row["completion"] is not None for row in result.samples)
    logs = list((tmp_path / "logs").iterdir())
    assert [path.suffix for path in logs] == [".eval"]  # the log, and no staging folder left beside it
    with zipfile.ZipFile(logs[0]) as archive:
        logged = b"".join(archive.read(name) for name in archive.namelist())
    assert SECRET_KEY.encode() not in logged
    assert sampler_path.encode() in logged


def test_a_failed_run_records_nothing(benchmark_mirror: Path, tiny_target, tmp_path: Path) -> None:
    target = replace(tiny_target, model="tinker://no-such-run/sampler_weights/final")
    with pytest.raises(BenchmarkRunError, match="no-such-run/sampler_weights/final does not exist"):
        run_benchmark("mmlu", target, tmp_path / "logs", limit=2)
    assert list((tmp_path / "logs").iterdir()) == []


def test_bad_limit_is_refused_before_anything_runs(tiny_target, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="limit must be a positive"):
        run_benchmark("gsm8k", tiny_target, tmp_path, limit=0)
