"""Benchmarks in the code location: the sensor and schedule request each (model, benchmark) once, the asset
records a result (log, samples, MLflow tags) or nothing, the leaderboard joins them, the CLI runs the asset."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from assets.benchmarks import BENCHMARK_PARTITIONS, BenchmarkKey, base_key, benchmark_result, ensure_partitions, leaderboard, result_dir
from assets.checkpoint_manifest import CheckpointManifest, read_manifest, write_manifest
from pipelines.benchmarks import BenchmarkSuite, benchmark_definitions, failure_message, newest_per_recipe, run_cli
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


def _checkpoint(partition: str, parent: str | None = None) -> CheckpointManifest:
    """A checkpoint manifest as training writes it (the automation reads nothing else of a checkpoint)."""
    recipe = partition.split("-")[0]
    manifest = CheckpointManifest(
        partition=partition, recipe=recipe, name=partition, step=int(partition.rsplit("-", 1)[1]), epoch=None, final=True,
        state_path=f"tinker://{partition}/weights/final", sampler_path=f"tinker://{partition}/sampler_weights/final",
        base_model=TINY_MODEL, base_model_digest="", renderer="chatml", training_dagster_run_id="run", training_asset=f"{recipe}_checkpoint",
        log_dir="", mlflow_run_id="", mlflow_run_url="", registered_model=f"posttrain-{recipe}", model_version="1", parent_partition=parent,
    )
    write_manifest(manifest)
    return manifest


@pytest.fixture
def no_local_datasets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A fresh offline clone: no mirror, an empty ``datasets`` cache."""
    import datasets.config

    monkeypatch.delenv("POSTTRAIN_HUB_MIRROR", raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))


def test_the_default_suite_leaves_out_benchmarks_whose_data_is_not_here_and_says_how_to_fix_it(
    dagster_instance: dg.DagsterInstance, mlflow_resource, no_local_datasets, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    suite = dataclasses.replace(BenchmarkSuite.from_env(), trigger="every")
    assert suite.benchmarks == ("arithmetic_gsm8k", "arithmetic_choice", "gsm8k", "mmlu")
    _checkpoint("sft-1a2b3c4d-000010")
    dagster_instance.add_dynamic_partitions("sft_checkpoints", ["sft-1a2b3c4d-000010"])
    defs = dg.Definitions.merge(benchmark_definitions(suite), dg.Definitions(resources=tiny_resources(tmp_path)))
    sensor = defs.resolve_sensor_def("benchmark_new_checkpoints")
    schedule = defs.resolve_schedule_def("benchmark_newest_checkpoints")

    with dg.build_sensor_context(instance=dagster_instance, resources={"mlflow": mlflow_resource}) as context:
        requested = list(sensor(context))
    base = base_key(TINY_MODEL)
    assert {request.partition_key for request in requested} == {
        f"{model}|{task}" for model in ("sft-1a2b3c4d-000010", base) for task in ("arithmetic_gsm8k", "arithmetic_choice")
    }
    warnings = [line.split(" - WARNING - ", 1)[1] for line in capsys.readouterr().err.splitlines() if " - WARNING - " in line]
    assert [line.split(":", 1)[0] for line in warnings] == ["gsm8k not requested for 2 model(s)", "mmlu not requested for 2 model(s)"]
    assert "$POSTTRAIN_HUB_MIRROR/openai/gsm8k" in warnings[0] and "load_dataset('openai/gsm8k', 'main', split='test')" in warnings[0]
    with dg.build_sensor_context(instance=dagster_instance, resources={"mlflow": mlflow_resource}) as context:
        (skip,) = list(sensor(context))
    assert isinstance(skip, dg.SkipReason) and skip.skip_message.startswith("no new checkpoint to benchmark")
    assert "gsm8k not requested" in skip.skip_message and "mmlu not requested" in skip.skip_message
    assert "HF_DATASETS_OFFLINE=1" in skip.skip_message and "$POSTTRAIN_HUB_MIRROR/cais/mmlu" in skip.skip_message
    (skip,) = list(schedule(dg.build_schedule_context(instance=dagster_instance)))
    assert skip.skip_message.startswith("the newest checkpoint of every recipe is benchmarked already; gsm8k not requested")

    monkeypatch.setenv("POSTTRAIN_HUB_MIRROR", str(BENCHMARK_HUB))  # the data arrives: the next tick requests it
    _checkpoint("dpo-5e6f7a8b-000005", parent="sft-1a2b3c4d-000010")
    dagster_instance.add_dynamic_partitions("dpo_checkpoints", ["dpo-5e6f7a8b-000005"])
    capsys.readouterr()
    scheduled = list(schedule(dg.build_schedule_context(instance=dagster_instance)))
    assert {request.partition_key for request in scheduled} == (
        {f"dpo-5e6f7a8b-000005|{task}" for task in suite.benchmarks}
        | {f"{model}|{task}" for model in ("sft-1a2b3c4d-000010", base) for task in ("gsm8k", "mmlu")}
    )
    assert " - WARNING - " not in capsys.readouterr().err


def test_a_misspelt_suite_benchmark_is_named_not_requested(
    dagster_instance: dg.DagsterInstance, mlflow_resource, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    monkeypatch.setenv("POSTTRAIN_BENCHMARKS", "arithmetic_choice,gsm9k,inspect_evals/boolq")
    suite = dataclasses.replace(BenchmarkSuite.from_env(), trigger="every")
    _checkpoint("sft-1a2b3c4d-000010")
    defs = dg.Definitions.merge(benchmark_definitions(suite), dg.Definitions(resources=tiny_resources(tmp_path)))
    with dg.build_sensor_context(instance=dagster_instance, resources={"mlflow": mlflow_resource}) as context:
        requested = {request.partition_key for request in defs.resolve_sensor_def("benchmark_new_checkpoints")(context)}
    assert requested == {f"{model}|{task}" for model in ("sft-1a2b3c4d-000010", base_key(TINY_MODEL)) for task in ("arithmetic_choice", "inspect_evals/boolq")}
    assert "gsm9k not requested for 2 model(s): 'gsm9k' is no benchmark; fix POSTTRAIN_BENCHMARKS: use arithmetic_choice, arithmetic_gsm8k, gsm8k" in capsys.readouterr().err


def test_a_bad_pair_fails_naming_the_fix_and_records_nothing(
    dagster_instance: dg.DagsterInstance, mlflow_resource, no_local_datasets, tmp_path: Path
) -> None:
    resources = {**tiny_resources(tmp_path), "mlflow": mlflow_resource}
    cases = {
        "sft-deadbeef-000009|arithmetic_gsm8k": "no checkpoint manifest",  # a checkpoint that does not exist
        f"{base_key(TINY_MODEL)}|gsm8k": "Fix: put a copy laid out like the hub repository at $POSTTRAIN_HUB_MIRROR/openai/gsm8k",
        f"{base_key(TINY_MODEL)}|gsm9k": "unknown task 'gsm9k'",
    }
    for partition, message in cases.items():
        ensure_partitions(dagster_instance, [BenchmarkKey.parse(partition)])
        outcome = dg.materialize([benchmark_result], partition_key=partition, instance=dagster_instance, resources=resources, raise_on_error=False)
        assert not outcome.success and message in failure_message(outcome)
        records = dagster_instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=benchmark_result.key, asset_partitions=[partition]), limit=1
        ).records
        directory = result_dir(BenchmarkKey.parse(partition))
        assert not records and (not directory.exists() or not any(directory.iterdir())), partition


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
    metadata = outcome.asset_materializations_for_node("benchmark_result")[0].metadata
    assert metadata["mlflow_aliases"].value == f"/mlflow/#/models/{read_manifest(best).registered_model}"
    assert metadata["aliases_moved_at_materialization"].value == "none"  # `best` follows the eval score here
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
