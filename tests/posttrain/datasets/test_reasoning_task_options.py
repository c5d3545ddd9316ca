"""reasoning-gym task options in a source spec: `task?key=value&...`."""

from __future__ import annotations

import pytest

from posttrain.datasets import reasoning_tasks

EASY_ADDITION = (
    "reasoning_gym:basic_arithmetic?min_terms=2&max_terms=2&max_digits=2&operators=+"
    "&allow_parentheses=false&allow_negation=false"
)


def test_options_shape_the_generated_problems_and_keep_them_gradable() -> None:
    items = list(reasoning_tasks.generate(reasoning_tasks.parse_tasks(EASY_ADDITION), 20, seed=3))

    assert len(items) == 20
    for item in items:
        left, right = item.entry["question"].removeprefix("Calculate ").rstrip(".").split(" + ")
        assert 0 <= int(left) < 100 and 0 <= int(right) < 100
        assert int(item.entry["answer"]) == int(left) + int(right)
        assert reasoning_tasks.score(item.task, str(item.entry["answer"]), item.entry) == 1.0
        assert item.task == "basic_arithmetic" and "max_digits=2" in item.row_id


def test_option_variants_get_distinct_row_ids() -> None:
    plain = next(reasoning_tasks.generate(("basic_arithmetic",), 1, seed=0))
    easy = next(reasoning_tasks.generate(reasoning_tasks.parse_tasks(EASY_ADDITION), 1, seed=0))
    assert plain.row_id != easy.row_id


def test_option_values_are_typed() -> None:
    assert reasoning_tasks.task_options("t?a=2&b=0.5&c=false&d=+") == {"a": 2, "b": 0.5, "c": False, "d": "+"}


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("reasoning_gym:basic_arithmetic?bogus=1", "invalid options"),
        ("reasoning_gym:basic_arithmetic?max_digits", "is not key=value"),
    ],
)
def test_bad_options_say_which_task_and_option(source: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        list(reasoning_tasks.generate(reasoning_tasks.parse_tasks(source), 2, seed=0))
    assert "basic_arithmetic" in str(error.value)


def test_unknown_task_with_options_is_named() -> None:
    with pytest.raises(ValueError, match="no_such_task"):
        reasoning_tasks.parse_tasks("reasoning_gym:no_such_task?x=1")
