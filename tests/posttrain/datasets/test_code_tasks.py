"""Generated code tasks, HumanEval and the DeepCoder / LiveCodeBench fixtures, all run in the sandbox."""

from __future__ import annotations

import pytest

from posttrain.datasets import code_tasks, schemas
from posttrain.datasets.loaders import LoadSpec, load
from posttrain.datasets.problems import code_problems_from_table
from posttrain.rl.code_reward import code_rewards
from posttrain.sandbox import Limits, ProblemTests, SandboxPool

LIMITS = Limits(timeout_s=20, memory_mb=256)


def fenced(program: str) -> str:
    return f"```python\n{program}```"


def test_code_tasks_are_deterministic_with_a_stable_heldout_split():
    first = load(LoadSpec("code", "code_tasks:easy?count=400", heldout_fraction=0.1, seed=3)).table
    again = load(LoadSpec("code", "code_tasks:easy?count=400", heldout_fraction=0.1, seed=3)).table
    assert first.schema.equals(schemas.CODE_PROBLEMS) and first.num_rows == 400 and first.equals(again)
    rows = first.to_pylist()
    assert len({r["row_id"] for r in rows}) == 400 and all(r["row_id"].startswith("code_tasks:easy/") for r in rows)
    other_seed = {r["row_id"]: r for r in load(LoadSpec("code", "code_tasks:easy?count=400", heldout_fraction=0.1, seed=4)).table.to_pylist()}
    shared = [r for r in rows if r["row_id"] in other_seed]
    assert shared and all(other_seed[r["row_id"]]["split"] == r["split"] for r in shared)
    assert any(other_seed[r["row_id"]]["test_code"] != r["test_code"] for r in shared)  # the seed draws new inputs
    heldout = [r for r in rows if r["split"] == schemas.HELDOUT_SPLIT]
    assert 30 <= len(heldout) <= 50
    limited = load(LoadSpec("code", "code_tasks:easy", limit=5, seed=3)).table.num_rows
    assert limited == 5


def test_code_task_prompts_name_the_function():
    row = next(r for r in code_tasks.code_rows("code_tasks:easy", len(code_tasks.catalog()), 0) if r["entry_point"] == "add_three")
    assert row["prompt"].startswith("Write a Python function `add_three(x)` that returns x + 3.")
    assert row["reference_solution"] == "def add_three(x):\n    return x + 3\n"
    assert row["test_code"].count("assert candidate(") == code_tasks.TESTS_PER_TASK


def test_every_reference_passes_and_a_wrong_answer_fails():
    rows = code_tasks.code_rows("code_tasks:easy", 24, seed=0)
    responses = [fenced(r["reference_solution"]) for r in rows] + [fenced(r["starter_code"] + "    return None\n") for r in rows]
    with SandboxPool() as pool:
        grades = code_rewards(responses, rows + rows, limits=LIMITS, pool=pool)
    assert [g.reward for g in grades[:24]] == [1.0] * 24, [g.stderr_tail for g in grades if g.reward != 1.0][:1]
    assert [g.status for g in grades[24:]] == ["failed"] * 24


def test_bad_code_task_sources_are_explained():
    with pytest.raises(ValueError, match="unknown code task level 'hard'"):
        load(LoadSpec("code", "code_tasks:hard"))
    with pytest.raises(ValueError, match="only option is count"):
        load(LoadSpec("code", "code_tasks:easy?size=3"))
    with pytest.raises(ValueError, match="catalog has"):
        load(LoadSpec("code", "code_tasks:easy?count=100000"))
    with pytest.raises(ValueError, match="provides code problems"):
        load(LoadSpec("chat", "code_tasks:easy"))


def test_human_eval_runs_in_the_sandbox():
    problems = code_problems_from_table(load(LoadSpec("code", "human_eval")).table)
    sample = [problems[i] for i in (0, 32, 163)]  # 32 (find_zero) uses a helper defined in the prompt
    responses = [fenced(p.reference_solution) for p in sample] + [fenced(p.starter_code + "    return None\n") for p in sample]
    grades = code_rewards(responses, [ProblemTests.from_row(p) for p in sample * 2], limits=LIMITS)
    assert [g.status for g in grades] == ["passed"] * 3 + ["failed"] * 3


def test_deepcoder_and_livecodebench_tests_run(hub_mirror):
    deepcoder = load(LoadSpec("code", "deepcoder")).table.to_pylist()
    livecodebench = load(LoadSpec("code", "livecodebench")).table.to_pylist()
    prime = load(LoadSpec("code", "deepcoder", config_name="primeintellect")).table.to_pylist()
    cases = [
        (deepcoder[0], "a, b = map(int, input().split())\nprint(a + b)\n", "print(0)\n"),
        (deepcoder[1], "class Solution:\n    def maxOf(self, nums: List[int]) -> int:\n        return max(nums)\n",
         "class Solution:\n    def maxOf(self, nums: List[int]) -> int:\n        return min(nums)\n"),
        (livecodebench[0], "print(2 * int(input()))\n", "print(int(input()))\n"),
        (livecodebench[1], "class Solution:\n    def sumList(self, nums):\n        return sum(nums)\n", "def sumList(nums):\n    return 0\n"),
        (prime[0], "print(input()[::-1])\n", "print(input())\n"),
    ]
    rows = [row for row, _, _ in cases]
    responses = [fenced(good) for _, good, _ in cases] + [fenced(bad) for _, _, bad in cases]
    grades = code_rewards(responses, rows + rows, limits=LIMITS)
    assert [g.reward for g in grades] == [1.0] * 5 + [0.0] * 5, [(g.status, g.stderr_tail[-200:]) for g in grades]
    functional_plain = ProblemTests.from_row({**deepcoder[1], "row_id": "plain"})
    assert functional_plain.prelude == "from typing import *\n" and functional_plain.stdin_cases == ()
