"""Benchmarks in the code location: the sensor and schedule request each (model, benchmark) once, the asset
records a result (log, samples, MLflow tags) or nothing, the leaderboard joins them, the CLI runs the asset."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from assets.benchmarks import BENCHMARK_PARTITIONS, BenchmarkKey, base_key, benchmark_result, leaderboard, result_dir
from assets.checkpoint_manifest import read_manifest
from pipelines.benchmarks import BenchmarkSuite, benchmark_definitions, newest_per_recipe, run_cli
from resources.mlflow import ALIAS_BEST
from tests.fixtures.dagster_env import TINY_MODEL, tiny_resources

BENCHMARK_HUB = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks_hub"
SUITE = BenchmarkSuite(("gsm8k", "mmlu"), "best", limit=2)
RUN_CONFIG = {"ops": {"benchmark_result": {"config": {"limit": 2, "max_tokens": 4}}}}


def test_partition_keys_name_model_and_benchmark() -> None:
    key = BenchmarkKey.parse(f"{base_key('HuggingFaceTB/SmolLM2-135M-Instruct')}|gsm8k")
    assert (key.model, key.benchmark, key.is_base) == ("base:HuggingFaceTB/SmolLM2-135M-Instruct", "gsm8k", True)
    assert BenchmarkKey.parse("sft-1a2b3c4d-000010|inspect_evals/boolq").benchmark == "inspect_evals/boolq"
    with pytest.raises(ValueError, match="<checkpoint key or base:<model>>|<benchmark>"):
        BenchmarkKey.parse("sft-1a2b3c4d-000010")


def test_the_suite_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSTTRAIN_BENCHMARKS", "gsm8k, humaneval")
    monkeypatch.setenv("POSTTRAIN_BENCHMARK_TRIGGER", "every")
    monkeypatch.setenv("POSTTRAIN_BENCHMARK_LIMIT", "0")
    assert BenchmarkSuite.from_env() == BenchmarkSuite(("gsm8k", "humaneval"), "every", 0)
    monkeypatch.setenv("POSTTRAIN_BENCHMARK_TRIGGER", "sometimes")
    with pytest.raises(ValueError, match="best.*every"):
        BenchmarkSuite.from_env()


def test_the_daily_schedule_and_the_sensor_run_by_default(tmp_path: Path) -> None:
    defs = dg.Definitions.merge(benchmark_definitions(SUITE), dg.Definitions(resources=tiny_resources(tmp_path)))
    assert defs.resolve_schedule_def("benchmark_newest_checkpoints").default_status == dg.DefaultScheduleStatus.RUNNING
    assert defs.resolve_sensor_def("benchmark_new_checkpoints").default_status == dg.DefaultSensorStatus.RUNNING
    assert benchmark_result.op.pool == "tinker"


@pytest.mark.slow
def test_best_checkpoint_is_benchmarked_with_its_base_and_the_leaderboard_joins_them(sft_pipeline_run, monkeypatch, capsys) -> None:
    run = sft_pipeline_run
    for name, value in run.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("POSTTRAIN_HUB_MIRROR", str(BENCHMARK_HUB))
    instance = run.instance
    best = run.mlflow.alias_partition(read_manifest(run.requested_partitions[-1]).registered_model, ALIAS_BEST)
    defs = dg.Definitions.merge(benchmark_definitions(SUITE), dg.Definitions(resources=tiny_resources(run.state)))

    sensor = defs.resolve_sensor_def("benchmark_new_checkpoints")
    with dg.build_sensor_context(instance=instance, resources={"mlflow": run.mlflow}) as context:
        requests = list(sensor(context))
    wanted = {f"{best}|gsm8k", f"{best}|mmlu", f"{base_key(TINY_MODEL)}|gsm8k", f"{base_key(TINY_MODEL)}|mmlu"}
    assert {request.partition_key for request in requests} == wanted
    assert all(request.run_config == SUITE.run_config() for request in requests)
    with dg.build_sensor_context(instance=instance, resources={"mlflow": run.mlflow}) as context:
        again = list(sensor(context))
    assert [type(item) for item in again] == [dg.SkipReason]  # each pair is requested once
    schedule = defs.resolve_schedule_def("benchmark_newest_checkpoints")
    assert [manifest.partition for manifest in newest_per_recipe(instance)] == [run.requested_partitions[-1]]

    job = defs.resolve_job_def("benchmark")
    for model in (base_key(TINY_MODEL), best):
        outcome = job.execute_in_process(instance=instance, partition_key=f"{model}|gsm8k", run_config=RUN_CONFIG)
        assert outcome.success
    key = BenchmarkKey(best, "gsm8k")
    files = sorted(path.name for path in result_dir(key).iterdir())
    assert files[-2:] == ["result.json", "samples.parquet"] and files[0].endswith(".eval")
    assert pq.read_table(result_dir(key) / "samples.parquet").num_rows == 2
    assert json.loads((result_dir(key) / "result.json").read_text())["n"] == 2
    manifest = read_manifest(best)
    tags = run.mlflow.get_client().get_model_version(manifest.registered_model, manifest.model_version).tags
    assert tags["benchmark.gsm8k.n"] == "2"
    logged = run.mlflow.get_client().get_logged_model(manifest.mlflow_model_id)
    assert {metric.key for metric in logged.metrics} >= {"benchmark/gsm8k", "benchmark/gsm8k_stderr", "benchmark/gsm8k_n"}

    board = dg.materialize([leaderboard], instance=instance, resources={"mlflow": run.mlflow})
    metadata = board.asset_materializations_for_node("leaderboard")[0].metadata
    text = metadata["leaderboard"].value
    assert f"| {base_key(TINY_MODEL)} | — |" in text and f"| {best} | {base_key(TINY_MODEL)} |" in text
    assert "Δ" in text  # the checkpoint is compared with its base, paired on the same two problems
    assert Path(metadata["chart"].value).read_bytes()[:4] == b"\x89PNG"

    assert run_cli(None, [], 0, 0, {}, show_leaderboard=True) == 0
    printed = capsys.readouterr().out
    assert f"| {best} | {base_key(TINY_MODEL)} |" in printed and "chart: " in printed

    # a failed run (unknown task) records nothing; the CLI says what is wrong
    assert run_cli(best, ["gsm9k"], 2, 4, {}) == 2
    assert not instance.has_dynamic_partition(BENCHMARK_PARTITIONS.name, f"{best}|gsm9k")
    assert not result_dir(BenchmarkKey(best, "gsm9k")).exists()
    assert run_cli("sft-deadbeef-000009", ["gsm8k"], 2, 4, {}) == 2
    assert list(schedule(dg.build_schedule_context(instance=instance))) == [dg.SkipReason("the newest checkpoint of every recipe is benchmarked already")]
