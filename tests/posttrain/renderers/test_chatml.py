"""chatml / smollm2 against SmolLM2's own chat template, token for token."""

from __future__ import annotations

import pytest

from posttrain.renderers import ParseTermination, TrainOnWhat, get_renderer
from tests.posttrain.renderers.conversations import plain_corpus

SPECIAL_TEXTS = ("<|im_end|>", "<|im_start|>", "<|endoftext|>")


def _template_tokens(tokenizer, messages, add_generation_prompt=False) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _template_safe(conversation) -> bool:
    """Two deliberate differences from the template, both about its tokenizing one whole string: it turns
    special-token text inside content into control tokens (we keep it text), and whitespace-only content
    merges with the header's newline into one token (we keep the header's tokens, so the generation
    prompt is always a prefix of the training sequence)."""
    return not any(
        any(marker in message["content"] for marker in SPECIAL_TEXTS) or (message["content"] and not message["content"].strip())
        for message in conversation
    )


def test_whitespace_only_content_keeps_the_prompt_a_prefix(smollm2_tokenizer):
    renderer = get_renderer("chatml", smollm2_tokenizer)
    conversation = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "   "}]
    tokens = renderer.build_supervised_example(conversation)[0].to_ints()
    prompt = renderer.build_generation_prompt(conversation[:-1]).to_ints()
    assert tokens[: len(prompt)] == prompt
    assert renderer.decode(tokens) == smollm2_tokenizer.apply_chat_template(conversation, tokenize=False)


@pytest.fixture(scope="module")
def conversations():
    return [c for c in plain_corpus(seed=5, size=120) if _template_safe(c)]


def test_chatml_equals_the_smollm2_chat_template(smollm2_tokenizer, conversations):
    renderer = get_renderer("chatml", smollm2_tokenizer)
    with_system = [c for c in conversations if c[0]["role"] == "system"]
    assert len(with_system) > 20
    for conversation in with_system:
        tokens = renderer.build_supervised_example(conversation)[0].to_ints()
        assert tokens == _template_tokens(smollm2_tokenizer, conversation)
        prompt = renderer.build_generation_prompt(conversation[:-1]).to_ints()
        assert prompt == _template_tokens(smollm2_tokenizer, conversation[:-1], add_generation_prompt=True)


def test_smollm2_adds_the_default_system_prompt_like_the_template(smollm2_tokenizer, conversations):
    renderer = get_renderer("smollm2", smollm2_tokenizer)
    assert len(conversations) > 40
    for conversation in conversations:
        assert renderer.build_supervised_example(conversation)[0].to_ints() == _template_tokens(smollm2_tokenizer, conversation)
        prompt = renderer.build_generation_prompt(conversation[:-1]).to_ints()
        assert prompt == _template_tokens(smollm2_tokenizer, conversation[:-1], add_generation_prompt=True)


def test_trained_tokens_are_the_final_answer_and_its_end(smollm2_tokenizer):
    renderer = get_renderer("chatml", smollm2_tokenizer)
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    model_input, weights = renderer.build_supervised_example(conversation)
    tokens = model_input.to_ints()
    assert weights.dtype.name == "float32" and len(weights) == len(tokens)
    assert renderer.decode([t for t, w in zip(tokens, weights) if w]) == "6<|im_end|>"  # up to the stop token
    assert renderer.decode(tokens).endswith("6<|im_end|>\n")  # the newline stays, untrained
    _, all_weights = renderer.build_supervised_example(conversation, TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    assert renderer.decode([t for t, w in zip(tokens, all_weights) if w]) == "4<|im_end|>6<|im_end|>"
    _, every_weight = renderer.build_supervised_example(conversation, TrainOnWhat.ALL_TOKENS)
    assert every_weight.min() == 1.0



def test_special_token_text_in_content_stays_text(smollm2_tokenizer):
    renderer = get_renderer("chatml", smollm2_tokenizer)
    end_id = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    conversation = [{"role": "user", "content": "fake <|im_end|> end"}, {"role": "assistant", "content": "no <|im_start|>"}]
    tokens = renderer.build_supervised_example(conversation)[0].to_ints()
    assert tokens.count(end_id) == 2  # one per real turn end, none from the content
    assert renderer.decode(tokens) == smollm2_tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}] + conversation, tokenize=False
    ).removeprefix("<|im_start|>system\nS<|im_end|>\n")


def test_parse_response(smollm2_tokenizer):
    renderer = get_renderer("chatml", smollm2_tokenizer)
    end_id = renderer.get_stop_sequences()[0]
    answer = smollm2_tokenizer("The answer is 4.", add_special_tokens=False)["input_ids"]
    assert renderer.parse_response(answer + [end_id]) == ({"role": "assistant", "content": "The answer is 4."}, ParseTermination.STOP_SEQUENCE)
    message, termination = renderer.parse_response(answer[:3])
    assert termination == ParseTermination.MALFORMED and message["content"] == smollm2_tokenizer.decode(answer[:3])
    assert renderer.parse_response(answer + [end_id] + answer + [end_id])[1] == ParseTermination.MALFORMED
