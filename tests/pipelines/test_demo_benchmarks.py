"""`make demo`'s benchmark stage: the base model and a final checkpoint through the `benchmark` job, then the
leaderboard, printed as the demo prints it."""

from __future__ import annotations

import dagster as dg
import pytest

from assets.benchmarks import BENCHMARK_PARTITIONS, base_key, benchmark_result
from pipelines.demo import DEMO_BENCHMARKS, format_benchmarks, run_benchmark_stage
from tests.fixtures.dagster_env import TINY_MODEL


@pytest.mark.slow
def test_the_demo_benchmarks_base_and_checkpoint_through_the_job_and_prints_the_leaderboard(sft_pipeline_run, monkeypatch) -> None:
    run = sft_pipeline_run
    for name, value in run.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("POSTTRAIN_HUB_MIRROR", raising=False)  # generated benchmarks: no dataset needed
    final = run.requested_partitions[-1]
    result = run_benchmark_stage(run.defs, run.instance, [base_key(TINY_MODEL), final], limit=2)

    wanted = [f"{model}|{benchmark}" for model in (base_key(TINY_MODEL), final) for benchmark in DEMO_BENCHMARKS]
    assert result.partitions == wanted
    for partition in wanted:  # each a materialization of the asset, by the job the sensor launches
        assert run.instance.has_dynamic_partition(BENCHMARK_PARTITIONS.name, partition)
        record = run.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=benchmark_result.key, asset_partitions=[partition]), limit=1
        ).records[0]
        assert run.instance.get_run_by_id(record.run_id).job_name == "benchmark"
    lines = result.leaderboard.splitlines()
    assert lines[0].startswith("model / benchmark") and "Δ vs parent" in lines[0]
    assert [line for line in lines if not line.startswith(" ")][1:] == [base_key(TINY_MODEL), f"{final}  (parent {base_key(TINY_MODEL)})"]
    benchmark_lines = [line.split() for line in lines if line.startswith("  ")]
    assert [words[0] for words in benchmark_lines] == sorted(DEMO_BENCHMARKS) * 2
    assert all(words[-1] == "(2)" or words[-2] == "(2)" for words in benchmark_lines[2:])  # paired with its parent on the same 2 problems
    printed = format_benchmarks(result)
    assert printed.startswith("== leaderboard: ") and "(limit 2 each)" in printed and f"chart: {result.chart}" in printed and "inspect view --log-dir " in printed
    assert open(result.chart, "rb").read(4) == b"\x89PNG"
