"""Eval reports from per-item scores: n and s.e. on every row, deltas paired on the same items, one readable table."""

import math

import pytest

from posttrain.eval.items import AGGREGATE_KEY, prompt_key, score_items, unique_keys
from posttrain.eval.report import comparison_rows, markdown, report_table, worse
from posttrain.eval.stats import mean_estimate, paired_difference


def test_item_keys_follow_the_normalized_prompt_and_never_collide():
    assert prompt_key("What is  2 + 2?") == prompt_key("what is 2 + 2?")
    assert prompt_key("What is 2 + 2?") != prompt_key("What is 2 + 3?")
    keys = unique_keys(["a", "b", "A "])
    assert keys[0] != keys[1] and keys[2] == f"{keys[0]}#2"


def _items(values):
    return {f"k{i}": float(v) for i, v in enumerate(values)}


def test_rows_carry_n_stderr_and_a_difference_paired_on_common_items():
    parent = _items([0, 0, 1, 1, 0, 1, 0, 0, 1, 0])
    checkpoint = _items([1, 0, 1, 1, 1, 1, 0, 1, 1, 1])
    base = {**_items([0] * 10), "extra": 1.0}  # an item only the base scored is left out of the pairing
    rows = comparison_rows({"accuracy": checkpoint}, {"accuracy": base}, {"accuracy": parent})
    (row,) = rows
    own = mean_estimate(list(checkpoint.values()))
    paired = paired_difference(checkpoint, parent)
    assert row["n"] == 10 and row["checkpoint"] == pytest.approx(0.8) and row["checkpoint_stderr"] == pytest.approx(own.stderr)
    assert row["delta_parent"] == pytest.approx(0.4) and row["delta_parent_stderr"] == pytest.approx(paired.stderr)
    assert row["significant_parent"] == paired.significant
    assert row["delta_base"] == pytest.approx(0.8) and row["vs_base"] == "better"
    assert report_table(rows).num_rows == 1


def test_a_difference_within_two_standard_errors_is_neither_better_nor_worse():
    parent = _items([1, 0] * 10)
    checkpoint = dict(parent, k0=0.0)  # one item flips: far inside the noise
    (row,) = comparison_rows({"accuracy": checkpoint}, {"accuracy": parent}, {"accuracy": parent})
    assert row["delta_parent"] < 0 and row["vs_parent"] == "within noise" and not row["significant_parent"]
    assert worse([row], "parent") == []
    (row,) = comparison_rows({"nll": _items([3.0] * 10 + [3.1] * 10)}, {"nll": _items([1.0] * 10 + [1.1] * 10)})
    assert row["vs_base"] == "worse" and worse([row]) == ["nll"]  # lower is better, and it rose beyond noise


def test_markdown_is_one_rounded_table_with_n_and_a_marked_delta():
    base, parent = _items([0] * 40), _items([1, 0] * 20)
    checkpoint = _items([1] * 38 + [0, 0])
    rows = comparison_rows({"accuracy": checkpoint}, {"accuracy": base}, {"accuracy": parent})
    text = markdown(rows, "title", has_parent=True)
    assert text.count("| metric | n | base | parent | checkpoint | Δ vs parent (± s.e.) |") == 1
    line = next(line for line in text.splitlines() if line.startswith("| accuracy"))
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[:5] == ["accuracy", "40", "0.000", "0.500", "0.950"]
    assert cells[5].startswith("+0.450 ± 0.0") and cells[5].endswith("▲")
    assert "0.95000000" not in text and "num_samples" not in text


def test_aggregate_only_evaluators_become_one_item_rows():
    class Aggregate:
        def __call__(self, target):
            return {"score": 0.5}

    class PerItem:
        def __call__(self, target):
            raise AssertionError("a report asks for items, not the mean")

        def score_items(self, target):
            return {"accuracy": {"a": 1.0, "b": 0.0}}

    items = score_items([Aggregate(), PerItem()], target=None)
    assert items == {"score": {AGGREGATE_KEY: 0.5}, "accuracy": {"a": 1.0, "b": 0.0}}
    (accuracy, score) = comparison_rows(items, items)
    assert score["n"] == 1 and math.isnan(score["checkpoint_stderr"])
