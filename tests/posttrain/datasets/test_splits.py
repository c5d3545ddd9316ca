"""Held-out membership is a function of a row's normalized prompt alone."""

from __future__ import annotations

import random

import pytest

from posttrain.datasets.loaders import LoadSpec, load
from posttrain.datasets.rows import EmptyDatasetError
from posttrain.datasets.splits import conversation_prompt, normalize_prompt, prompt_position, row_prompt, split_of
from tests.fixtures.data import chat_line


def test_normalization_ignores_whitespace_and_case():
    assert normalize_prompt("  What IS\n\t2 +  2? ") == "what is 2 + 2?"
    assert split_of("What is 2 + 2?", 0.5) == split_of("what is  2 +\n2?", 0.5)
    assert prompt_position("a") != prompt_position("b")


def test_threshold_not_rank_share_is_close_to_the_fraction_and_monotone():
    prompts = [f"question {i}" for i in range(4000)]
    heldout = {p for p in prompts if split_of(p, 0.1) == "heldout"}
    assert 0.08 < len(heldout) / len(prompts) < 0.12
    assert heldout <= {p for p in prompts if split_of(p, 0.2) == "heldout"}  # a bigger fraction only adds prompts
    assert all(split_of(p, 0.0) == "train" for p in prompts[:100])
    with pytest.raises(ValueError, match="heldout_fraction must be in"):
        split_of("x", 1.0)


def test_the_prompt_of_each_kind_is_what_precedes_the_trained_answer():
    conversation = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
    ]
    assert conversation_prompt(conversation) == "system: S\nuser: Q1\nassistant: A1\nuser: Q2"
    assert row_prompt("chat", {"messages": conversation}) == row_prompt("comparison", {"prompt": conversation[:-1]})
    assert row_prompt("rl", {"question": "Q"}) == "Q" and row_prompt("code", {"prompt": "P"}) == "P"
    # one question asked in a chat, a comparison and a problems table: one prompt, so one side of the split
    question = [{"role": "user", "content": "Calculate 43 + 12."}]
    assert row_prompt("chat", {"messages": question + [{"role": "assistant", "content": "55"}]}) == "Calculate 43 + 12."
    assert row_prompt("comparison", {"prompt": question}) == row_prompt("rl", {"question": "Calculate 43 + 12."})


def _split_by_prompt(table) -> dict[str, set[str]]:
    sides: dict[str, set[str]] = {}
    for row in table.to_pylist():
        sides.setdefault(normalize_prompt(row["messages"][0]["content"]), set()).add(row["split"])
    return sides


def test_splits_agree_across_limits_and_orders_and_duplicates_share_a_side(write_jsonl):
    rng = random.Random(0)
    questions = [f"What is {i} times {i + 3}?" for i in range(60)]
    lines = [chat_line(q, str(rng.randint(0, 99))) for q in questions for _ in range(2)]  # every prompt twice
    lines += [chat_line(q.upper() + "  ", "x") for q in questions[:10]]  # same prompts, reformatted
    rng.shuffle(lines)
    forward = write_jsonl(lines, name="forward.jsonl")
    backward = write_jsonl(lines[::-1], name="backward.jsonl")
    small = load(LoadSpec("chat", str(forward), limit=40, heldout_fraction=0.3)).table
    large = load(LoadSpec("chat", str(forward), heldout_fraction=0.3)).table
    reordered = load(LoadSpec("chat", str(backward), limit=90, heldout_fraction=0.3)).table
    sides = [_split_by_prompt(table) for table in (small, large, reordered)]
    for by_prompt in sides:
        assert all(len(splits) == 1 for splits in by_prompt.values())  # duplicates never straddle the split
    merged: dict[str, set[str]] = {}
    for by_prompt in sides:
        for prompt, splits in by_prompt.items():
            merged.setdefault(prompt, set()).update(splits)
    assert all(len(splits) == 1 for splits in merged.values())  # no held-out prompt is a training prompt elsewhere
    counts = large.column("split").to_pylist()
    assert 0 < counts.count("heldout") < len(counts)


def test_a_table_with_no_training_row_is_refused(write_jsonl):
    heldout_question = next(f"q{i}" for i in range(100) if split_of(f"q{i}", 0.5) == "heldout")
    path = write_jsonl([chat_line(heldout_question, "a")])
    with pytest.raises(EmptyDatasetError, match="all 1 rows hash into the held-out split"):
        load(LoadSpec("chat", str(path), heldout_fraction=0.5))
