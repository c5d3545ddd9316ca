"""parse_response(render(x)) gives x back: re-rendering the parsed message reproduces the tokens."""

from __future__ import annotations

import json

import pytest

from posttrain.renderers import ParseTermination, get_renderer
from tests.posttrain.renderers.conversations import corpus

CASES = [
    ("chatml", "smollm2_tokenizer", {"reasoning": "none", "tools": False}),
    ("qwen3", "qwen3_tokenizer", {"reasoning": "all"}),
    ("qwen3_disable_thinking", "qwen3_tokenizer", {"reasoning": "history"}),
    ("qwen3_instruct", "qwen3_tokenizer", {"reasoning": "none"}),
    ("deepseekv3", "deepseek_tokenizer", {"reasoning": "none", "systems": 2}),
    ("deepseekv3_thinking", "deepseek_tokenizer", {"reasoning": "all", "systems": 2}),
]


def _response(renderer, conversation) -> list[int]:
    tokens = renderer.build_supervised_example(conversation)[0].to_ints()
    prompt = renderer.build_generation_prompt(conversation[:-1]).to_ints()
    assert tokens[: len(prompt)] == prompt
    return tokens[len(prompt) :]


@pytest.mark.parametrize(("name", "tokenizer_fixture", "options"), CASES)
def test_render_parse_render_is_stable(name, tokenizer_fixture, options, request):
    renderer = get_renderer(name, request.getfixturevalue(tokenizer_fixture))
    for index, conversation in enumerate(corpus(seed=21, size=30, **options)):
        response = _response(renderer, conversation)
        message, termination = renderer.parse_response(response)
        assert termination == ParseTermination.STOP_SEQUENCE, f"{name} conversation {index}"
        again = renderer.build_supervised_example(conversation[:-1] + [message])[0].to_ints()
        assert again == renderer.build_supervised_example(conversation)[0].to_ints(), f"{name} conversation {index}: {message!r}"
        stop_at = next(i for i, token in enumerate(response) if token in renderer.get_stop_sequences())
        truncated, truncated_termination = renderer.parse_response(response[:stop_at])
        assert truncated_termination == ParseTermination.MALFORMED and truncated["role"] == "assistant"


@pytest.mark.parametrize(("name", "tokenizer_fixture"), [("qwen3", "qwen3_tokenizer"), ("deepseekv3_thinking", "deepseek_tokenizer")])
def test_reasoning_and_tool_calls_parse_exactly(name, tokenizer_fixture, request):
    renderer = get_renderer(name, request.getfixturevalue(tokenizer_fixture))
    arguments = json.dumps({"city": "Paris", "days": [1, 2]})
    final = {
        "role": "assistant",
        "content": [{"type": "thinking", "thinking": "need weather"}, {"type": "text", "text": "Checking <tool_call> now."}],
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": arguments}}],
    }
    message, termination = renderer.parse_response(_response(renderer, [{"role": "user", "content": "Weather?"}, final]))
    assert termination == ParseTermination.STOP_SEQUENCE
    assert message == final
