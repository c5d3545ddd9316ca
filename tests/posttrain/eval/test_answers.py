import pytest

from posttrain.eval.answers import extract_answer, extract_boxed


@pytest.mark.parametrize(
    "response, expected",
    [
        ("The answer is 42.", "42"),
        ("Steps: 3 + 4 = 7, then \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
        ("a \\boxed{1} then \\boxed{2}", "2"),
        ("3 + 4 = 7 so 7", "7"),
        ("work...\n#### 1,234\n", "1234"),
        ("Answer: $5", "5"),
        ("Final answer: -3.5", "-3.5"),
        ("The answer is Paris.", "Paris"),
        ("I do not know", None),
        ("", None),
        ("12 apples and 30 pears: the answer is 30, not 12", "30"),
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


def test_boxed_with_nested_and_unbalanced_braces():
    assert extract_boxed("\\boxed{a{b}c}") == "a{b}c"
    assert extract_boxed("\\boxed{open") is None


def test_default_grade_uses_the_problems_own_scorer_when_it_names_one():
    from posttrain.eval.accuracy import TaskProblem, default_grade

    plain = TaskProblem(question="q", answer="1,000")
    assert default_grade("1000", plain) == 1.0 and default_grade("999", plain) == 0.0
    exact = TaskProblem(question="q", answer="Paris", scorer="exact_match")
    assert default_grade("Paris", exact) == 1.0 and default_grade("paris", exact) == 0.0
