"""Rendering tables to training rows with the real chatml renderer and SmolLM2's tokenizer."""

import pytest

from posttrain.datasets import schemas, tokens
from posttrain.datasets.loaders import LoadSpec, load
from posttrain.datasets.rows import BadRowError, SkipLog
from posttrain.renderers import get_renderer


@pytest.fixture(scope="module")
def chatml(data_tokenizer):
    return get_renderer("chatml", data_tokenizer)


def test_rows_are_shifted_renderer_examples(chatml, data_tokenizer):
    chat = load(LoadSpec("chat", "reasoning_gym:chain_sum", limit=3)).table
    table = tokens.render_chat_table(chat, chatml, "last_assistant_message", None)
    assert table.schema.equals(schemas.RENDERED_TOKENS)
    for conversation, row in zip(chat.to_pylist(), table.to_pylist(), strict=True):
        model_input, weights = chatml.build_supervised_example(conversation["messages"], tokens.train_on_what("last_assistant_message"))
        full = model_input.to_ints()
        assert row["model_input"] == full[:-1] and row["target_tokens"] == full[1:]
        assert row["weights"] == pytest.approx(list(weights[1:]))
        trained = [t for t, w in zip(row["target_tokens"], row["weights"], strict=True) if w > 0]
        assert data_tokenizer.decode(trained).startswith(conversation["messages"][-1]["content"] + "<|im_end|>")
        assert row["num_tokens"] == len(full) and not row["truncated"]


def test_truncation_is_reported(chatml):
    chat = load(LoadSpec("chat", "reasoning_gym:gsm_symbolic", limit=2)).table
    table = tokens.render_chat_table(chat, chatml, "all_messages", 20)
    assert table.column("truncated").to_pylist() == [True, True]
    assert all(len(ids) == 19 for ids in table.column("model_input").to_pylist())


def test_train_on_what_names():
    assert tokens.train_on_what("ALL_ASSISTANT_MESSAGES").value == "all_assistant_messages"
    with pytest.raises(ValueError, match="unknown train_on_what 'everything'; expected one of last_assistant_message"):
        tokens.train_on_what("everything")


def test_unknown_renderer_lists_known_ones(data_tokenizer):
    with pytest.raises(ValueError, match="unknown renderer 'nope'; known renderers: .*chatml"):
        get_renderer("nope", data_tokenizer)


def test_pairs_share_prompt_and_problems_are_detected(chatml):
    comparisons = load(LoadSpec("comparison", "reasoning_gym:basic_arithmetic", limit=4)).table
    pairs = tokens.render_comparisons_table(comparisons, chatml, None)
    assert tokens.pair_problems(pairs) == []
    first = pairs.to_pylist()[0]
    prompt_only = chatml.build_generation_prompt(comparisons.column("prompt").to_pylist()[0]).to_ints()
    assert first["chosen_model_input"][: len(prompt_only)] == prompt_only
    assert first["prompt_length"] == len(prompt_only)
    same = pairs.set_column(pairs.schema.get_field_index("rejected_model_input"), "rejected_model_input", pairs.column("chosen_model_input"))
    same = same.set_column(same.schema.get_field_index("rejected_target_tokens"), "rejected_target_tokens", same.column("chosen_target_tokens"))
    assert all("render to the same tokens" in p for p in tokens.pair_problems(same))


def test_renderer_rejection_names_the_row(chatml):
    chat = load(LoadSpec("chat", "reasoning_gym:chain_sum", limit=3)).table
    # CUSTOMIZED needs a per-message 'trainable' flag, which normalized chat rows do not carry.
    with pytest.raises(BadRowError, match="chain_sum/seed0/0: cannot be rendered: .*no 'trainable' flag") as error:
        tokens.render_chat_table(chat, chatml, "customized", None)
    assert error.value.where == chat.column("row_id")[0].as_py()
    skip = SkipLog(skip_bad_rows=True)
    kept = tokens.render_chat_table(chat, chatml, "customized", None, skip)
    assert kept.num_rows == 0 and skip.count == 3
    assert skip.samples[2].startswith(chat.column("row_id")[2].as_py() + ": cannot be rendered")


def test_multi_turn_preset_comparisons_render_to_valid_pairs(chatml, hub_mirror, data_tokenizer):
    comparisons = load(LoadSpec("comparison", "hh_rlhf")).table
    pairs = tokens.render_comparisons_table(comparisons, chatml, None)
    assert tokens.pair_problems(pairs) == []
    multi = next(row for row in pairs.to_pylist() if row["row_id"] == "hh_rlhf/train/1")
    prompt_text = data_tokenizer.decode(multi["chosen_model_input"][: multi["prompt_length"]])
    assert prompt_text.count("<|im_start|>assistant") == 2  # earlier assistant turn is prompt, not trained
    trained = [t for t, w in zip(multi["rejected_target_tokens"], multi["rejected_weights"], strict=True) if w > 0]
    assert data_tokenizer.decode(trained).startswith("No.<|im_end|>")
