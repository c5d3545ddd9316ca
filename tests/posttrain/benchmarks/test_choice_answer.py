import pytest

from posttrain.benchmarks.choice_answer import picked_letter

OPTIONS = ["54", "55", "65", "56"]


@pytest.mark.parametrize(
    "completion, letter",
    [
        ("ANSWER: B", "B"),
        ("Let me add.\nANSWER: (c)", "C"),
        ("B) 55", "B"),
        ("(D)", "D"),
        ("A", "A"),
        ("55", "B"),  # the option's own text picks it
        ("65.", "C"),
        ("ANSWER: 56", "D"),
    ],
)
def test_each_way_of_stating_one_option_picks_it(completion, letter):
    assert picked_letter(completion, OPTIONS) == letter


@pytest.mark.parametrize("completion", ["", "57", "The answer is 55 or 56", "E) 55", "Apples"])
def test_no_option_or_an_unclear_one_picks_nothing(completion):
    assert picked_letter(completion, OPTIONS) is None


def test_text_shared_by_two_options_is_ambiguous():
    assert picked_letter("7", ["7", "7", "8", "9"]) is None
