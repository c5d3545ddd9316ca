"""tml:<family> renderers: other model families behind the same interface."""

from __future__ import annotations

import pytest

from posttrain.renderers import ParseTermination, RendererError, TrainOnWhat, get_renderer

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
]


@pytest.mark.parametrize("name", ["tml:kimi_k2", "tml:glm5_3", "tml:gpt_oss_medium"])
def test_other_families_render_train_and_parse(name):
    renderer = get_renderer(name)
    model_input, weights = renderer.build_supervised_example(CONVERSATION)
    tokens = model_input.to_ints()
    assert len(weights) == len(tokens) and 0 < weights.sum() < len(tokens)
    prompt = renderer.build_generation_prompt(CONVERSATION[:-1]).to_ints()
    assert tokens[: len(prompt)] == prompt and weights[: len(prompt)].sum() == 0
    response = tokens[len(prompt) :]
    message, termination = renderer.parse_response(response)
    assert termination == ParseTermination.STOP_SEQUENCE
    assert message["role"] == "assistant" and "4" in str(message["content"])
    assert renderer.get_stop_sequences()
    assert renderer.parse_response(response[:1])[1] == ParseTermination.MALFORMED


def test_modes_tml_cannot_express_are_refused():
    renderer = get_renderer("tml:kimi_k2")
    with pytest.raises(RendererError, match="trains assistant messages only"):
        renderer.build_supervised_example(CONVERSATION, TrainOnWhat.ALL_MESSAGES)
