"""math-verify grading of GSM8K-format and MATH answers."""

from __future__ import annotations

import pytest

from posttrain.eval.math_answers import answer_line, grade_math, same_value


@pytest.mark.parametrize(
    ("response", "gold"),
    [
        ("3 + 4 = 7 apples.\nANSWER: 7", "7"),
        ("She keeps 1,000 dollars.\nANSWER: $1,000", "1000"),
        ("ANSWER: 18 dollars", "18"),
        ("so the sum is \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
        ("ANSWER: 0.75", "\\frac{3}{4}"),
        ("ANSWER: x = 4", "4"),
        ("ANSWER: 2\\sqrt{2}", "2\\sqrt{2}"),
        ("ANSWER: (1, 2)", "(1,2)"),
    ],
)
def test_equal_answers_in_any_notation_are_correct(response: str, gold: str) -> None:
    assert grade_math(response, gold).correct


@pytest.mark.parametrize(
    ("response", "gold"),
    [
        ("Tom first had 7 apples, then 8.\nANSWER: 8", "7"),  # a number in the reasoning does not count
        ("I am not sure.", "7"),
        ("ANSWER: (1, 2)", "2"),  # an interval is not its right end
        ("ANSWER: \\sqrt{8}", "3"),
    ],
)
def test_wrong_or_missing_answers_are_incorrect(response: str, gold: str) -> None:
    assert not grade_math(response, gold).correct


def test_the_last_answer_line_is_the_one_graded() -> None:
    assert answer_line("ANSWER: 3\nno wait\nANSWER: 5") == "5"
    assert grade_math("ANSWER: 3\nno wait\nANSWER: 5", "5").extracted == "5"
    assert answer_line("no line here") is None


def test_grading_off_the_main_thread_works_without_the_alarm_timeout() -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(grade_math, "ANSWER: 1/2", "0.5").result().correct


@pytest.mark.parametrize(
    "predicted, gold, expected",
    [("1234", "1,234", True), ("1234.0", "1234", True), ("5", "$5", True), ("41", "42", False), ("3/4", "0.75", True),
     ("x = 4", "4", True), ("paris", "Paris.", True), (None, "1", False), ("", "1", False), ("0.1", "0.10", True),
     ("London", "Paris", False), ("Paris", "sirap", False)],  # math-verify alone reads a word as a product of symbols
)
def test_an_extracted_answer_has_the_gold_value(predicted, gold, expected) -> None:
    assert same_value(predicted, gold) is expected


def test_a_text_gold_answer_is_compared_as_text() -> None:
    assert grade_math("I think so.\nANSWER: New York", "new york").correct
    assert not grade_math("ANSWER: kroy wen", "New York").correct


def test_plain_numbers_compare_without_sympy(monkeypatch: pytest.MonkeyPatch) -> None:
    """RL envs grade off the main thread, where math-verify's sympy work has no time bound: numbers skip it."""
    import math_verify

    def unbounded(*args, **kwargs):
        raise AssertionError("math-verify called for plain numbers")

    monkeypatch.setattr(math_verify, "parse", unbounded)
    assert same_value("1,234", "1234") and same_value("$72.", "72") and not same_value("71", "72")
