"""bench/gpu_decisions.py: the verdict on each GPU default from one gpu_check.sh run's figures and test lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.gpu_decisions import DECISIONS, outcomes_of, verdict

REPO = Path(__file__).resolve().parents[2]
JOINED, GRAPHS, SDPA = DECISIONS
LINES = """test_decode_graphs_agree_with_the_trainer PASSED [ 26%]
tests/localtinker/engine/test_cuda.py::test_training_pieces_replayed_as_cuda_graphs_train_as_without FAILED [ 40%]
test_families_in_float32_on_the_gpu[gpt_oss] PASSED [ 90%]
test_decode_graphs_with_sdpa_attention_agree_with_the_trainer SKIPPED [100%]
"""


def test_outcomes_are_read_from_pytest_lines_with_or_without_path_and_parameters():
    assert outcomes_of(LINES) == {
        "test_decode_graphs_agree_with_the_trainer": "PASSED",
        "test_training_pieces_replayed_as_cuda_graphs_train_as_without": "FAILED",
        "test_families_in_float32_on_the_gpu": "PASSED",
        "test_decode_graphs_with_sdpa_attention_agree_with_the_trainer": "SKIPPED",
    }


def test_a_default_on_path_stays_on_only_while_its_test_passes_and_it_is_not_slower():
    passed = {JOINED.test: "PASSED"}
    assert verdict(JOINED, {JOINED.with_path: 12.0, JOINED.without: 11.0}, passed).startswith(f"{JOINED.name}: keep on")
    slower = verdict(JOINED, {JOINED.with_path: 10.0, JOINED.without: 11.0}, passed)
    assert slower.startswith(f"{JOINED.name}: turn off")
    failed = verdict(JOINED, {JOINED.with_path: 12.0, JOINED.without: 11.0}, {JOINED.test: "FAILED"})
    assert failed.startswith(f"{JOINED.name}: turn off") and "FAILED" in failed


def test_an_opt_in_path_turns_on_only_when_its_test_passes_and_it_is_faster():
    figures = {GRAPHS.with_path: 2.2, GRAPHS.without: 1.3}
    assert verdict(GRAPHS, figures, {GRAPHS.test: "PASSED"}).startswith(f"{GRAPHS.name}: turn on")
    assert verdict(GRAPHS, figures, {GRAPHS.test: "FAILED"}).startswith(f"{GRAPHS.name}: keep off")
    slower = {GRAPHS.with_path: 1.2, GRAPHS.without: 1.3}
    assert verdict(GRAPHS, slower, {GRAPHS.test: "PASSED"}).startswith(f"{GRAPHS.name}: keep off")
    unmeasured = verdict(GRAPHS, {GRAPHS.without: 1.3}, {GRAPHS.test: "PASSED"})
    assert unmeasured.startswith(f"{GRAPHS.name}: keep off") and "not measured" in unmeasured


def test_a_test_that_did_not_run_gives_no_verdict(tmp_path):
    """From the files gpu_check.sh leaves (a run cut short: the sdpa test skipped, no bench figures)."""
    (tmp_path / "bench_gpu.json").write_text(json.dumps({"1b.sample_ratio": 12.0}))
    (tmp_path / "gpu_tests.txt").write_text(LINES)
    result = subprocess.run([sys.executable, "bench/gpu_decisions.py", str(tmp_path / "bench_gpu.json"),
                             str(tmp_path / "gpu_tests.txt")], cwd=REPO, capture_output=True, text=True, check=True)
    lines = result.stdout.splitlines()
    assert len(lines) == len(DECISIONS)
    assert lines[0].startswith(f"{JOINED.name}: keep on") and "not measured" in lines[0]
    assert lines[1].startswith(f"{GRAPHS.name}: keep off") and "FAILED" in lines[1]
    assert lines[2].startswith(f"{SDPA.name}: no verdict, keep off until its test runs")
