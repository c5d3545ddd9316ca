"""Every renderer trains a final answer exactly up to the stop token the sampler is given, nothing after."""

from __future__ import annotations

import pytest

from posttrain.renderers import TrainOnWhat, get_renderer

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "6"},
]

TOKEN_STOP_RENDERERS = [
    ("chatml", "smollm2_tokenizer"),
    ("smollm2", "smollm2_tokenizer"),
    ("qwen3", "qwen3_tokenizer"),
    ("qwen3_disable_thinking", "qwen3_tokenizer"),
    ("qwen3_instruct", "qwen3_tokenizer"),
    ("deepseekv3", "deepseek_tokenizer"),
    ("deepseekv3_thinking", "deepseek_tokenizer"),
]


@pytest.mark.parametrize("name,tokenizer_fixture", TOKEN_STOP_RENDERERS)
@pytest.mark.parametrize("train_on_what", [TrainOnWhat.LAST_ASSISTANT_MESSAGE, TrainOnWhat.ALL_ASSISTANT_MESSAGES])
def test_each_trained_span_ends_at_a_stop_token(name, tokenizer_fixture, train_on_what, request):
    renderer = get_renderer(name, request.getfixturevalue(tokenizer_fixture))
    stops = renderer.get_stop_sequences()
    model_input, weights = renderer.build_supervised_example(CONVERSATION, train_on_what)
    tokens = model_input.to_ints()
    span_ends = [i for i, w in enumerate(weights) if w > 0 and (i + 1 == len(weights) or weights[i + 1] == 0)]
    assert len(span_ends) == (1 if train_on_what == TrainOnWhat.LAST_ASSISTANT_MESSAGE else 2)
    assert all(tokens[end] in stops for end in span_ends), [renderer.decode(tokens[end : end + 2]) for end in span_ends]


def test_role_colon_trains_up_to_its_stop_string(smollm2_tokenizer):
    renderer = get_renderer("role_colon", smollm2_tokenizer)
    (stop,) = renderer.get_stop_sequences()
    model_input, weights = renderer.build_supervised_example(CONVERSATION)
    tokens = model_input.to_ints()
    trained = renderer.decode([t for t, w in zip(tokens, weights) if w > 0])
    assert trained == " 6" + stop and weights[-1] > 0  # nothing after the stop string
