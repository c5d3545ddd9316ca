"""The cookbook's pairwise format: rendering, the trained label token, labelled comparisons from a table."""

import pytest

from posttrain.preference.comparison_format import (
    COMPLETION_A,
    COMPLETION_B,
    PREFERENCE,
    REFERENCE,
    Comparison,
    ComparisonRenderer,
    LabeledComparison,
    labeled_comparisons_from_table,
)
from posttrain.renderers import get_renderer
from tests.posttrain.preference.tiny_pairs import comparisons_table, tiny_tokenizer

COMPARISON = Comparison(
    [{"role": "user", "content": "What is 2 + 2?"}], [{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]
)


def renderer() -> ComparisonRenderer:
    return ComparisonRenderer(get_renderer("chatml", tiny_tokenizer()))


def test_conversation_has_the_cookbook_sections_in_order():
    roles_contents = [(m["role"], m["content"]) for m in COMPARISON.conversation()]
    assert roles_contents == [
        ("user", "What is 2 + 2?"), ("system", COMPLETION_A), ("assistant", "4"), ("system", COMPLETION_B), ("assistant", "5"),
        ("system", PREFERENCE),
    ]
    assert COMPARISON.swap().completion_a == COMPARISON.completion_b


def test_the_datum_trains_only_the_first_label_token_right_after_the_generation_prompt():
    rendered = renderer()
    tokenizer = tiny_tokenizer()
    prompt = rendered.renderer.build_generation_prompt(COMPARISON.conversation()).to_ints()
    scoring = rendered.scoring_input(COMPARISON)
    assert scoring.prompt_tokens == prompt
    assert {label: tokenizer.decode([token]) for label, token in scoring.label_tokens.items()} == {"A": "A", "B": "B", "Tie": "T"}
    for label in ("A", "B", "Tie"):
        datum = rendered.datum(LabeledComparison(COMPARISON, label))
        weights = datum.loss_fn_inputs["weights"].to_numpy()
        targets = datum.loss_fn_inputs["target_tokens"].to_numpy()
        assert weights.sum() == 1.0 and weights[-1] == 1.0  # the sequence ends at the label's first token
        assert int(targets[-1]) == scoring.label_tokens[label]
        assert datum.model_input.to_ints()[: len(prompt)] == prompt


def test_table_rows_become_both_orders_or_one_order_by_hash():
    table = comparisons_table(6, heldout_every=3)
    both = labeled_comparisons_from_table(table, "train")
    assert len(both) == 2 * 4
    assert [c.label for c in both[:2]] == ["A", "B"]
    assert both[0].comparison.completion_a == both[1].comparison.completion_b  # chosen first, then second
    one = labeled_comparisons_from_table(table, None, orders="one", seed=0)
    assert len(one) == 6 and {c.label for c in one} == {"A", "B"}
    assert one == labeled_comparisons_from_table(table, None, orders="one", seed=0)
    with pytest.raises(ValueError, match="orders"):
        labeled_comparisons_from_table(table, orders="random")


def test_a_reference_answer_sits_between_the_prompt_and_the_completions_in_both_orders():
    reference = [{"role": "assistant", "content": "4"}]
    with_reference = COMPARISON.with_reference(reference)
    roles_contents = [(m["role"], m["content"]) for m in with_reference.conversation()]
    assert roles_contents[:5] == [
        ("user", "What is 2 + 2?"), ("system", REFERENCE), ("assistant", "4"), ("system", COMPLETION_A), ("assistant", "4"),
    ]
    assert roles_contents[5:] == [("system", COMPLETION_B), ("assistant", "5"), ("system", PREFERENCE)]
    assert with_reference.swap().reference == reference and with_reference.swap().completion_a == COMPARISON.completion_b
    rendered = renderer()
    assert len(rendered.scoring_input(with_reference).prompt_tokens) > len(rendered.scoring_input(COMPARISON).prompt_tokens)


def test_table_rows_carry_the_chosen_completion_as_their_reference_when_asked():
    table = comparisons_table(6, heldout_every=3)
    plain = labeled_comparisons_from_table(table, "train")
    referenced = labeled_comparisons_from_table(table, "train", reference="chosen")
    assert all(c.comparison.reference is None for c in plain)
    for forward, swapped in zip(referenced[::2], referenced[1::2]):
        assert forward.comparison.reference == forward.comparison.completion_a  # the chosen side, label A
        assert swapped.comparison.reference == swapped.comparison.completion_b  # still the chosen side, label B
    with pytest.raises(ValueError, match="reference"):
        labeled_comparisons_from_table(table, reference="rejected")
