"""Our qwen3* and deepseekv3* renderers against tml-renderers' native ones: same conversations, same
tokenizer, identical tokens and weights (single examples, per-turn examples, generation prompts)."""

from __future__ import annotations

import pytest

from posttrain.renderers import RendererError, TrainOnWhat, get_renderer
from tests.posttrain.renderers.conversations import corpus

CASES = {
    # name: (tokenizer fixture, corpus options) -- options keep to what the format can express
    "qwen3": ("qwen3_tokenizer", {"reasoning": "all", "systems": 1}),
    "qwen3_disable_thinking": ("qwen3_tokenizer", {"reasoning": "history", "systems": 1}),
    "qwen3_instruct": ("qwen3_tokenizer", {"reasoning": "all", "systems": 1}),
    "deepseekv3": ("deepseek_tokenizer", {"reasoning": "none", "systems": 2}),
    "deepseekv3_thinking": ("deepseek_tokenizer", {"reasoning": "all", "systems": 2}),
}
CONVERSATIONS = 24


def _cookbook_form(name: str, conversation: list[dict]) -> list[dict]:
    """The conversation as tml-renderers 0.2.1 must see it to render what tinker-cookbook 0.6.1 renders.

    One known difference: for an answer right after a user message with text but no reasoning,
    cookbook 0.6.1's DeepSeekV3ThinkingRenderer closes the prefilled `<think>` (`<think></think>answer`)
    while tml-renderers 0.2.1 leaves it open (`<think>answer`). Giving that answer an empty reasoning
    part makes tml-renderers write the cookbook's tokens, so everything else is still compared to it."""
    if name != "deepseekv3_thinking":
        return conversation
    shown = []
    for index, message in enumerate(conversation):
        after_user = index > 0 and conversation[index - 1]["role"] == "user"
        if message["role"] == "assistant" and after_user and isinstance(message["content"], str) and message["content"]:
            message = {**message, "content": [{"type": "thinking", "thinking": ""}, {"type": "text", "text": message["content"]}]}
        shown.append(message)
    return shown


def _examples(renderer, conversation, mode):
    """The examples as plain lists, or "refused" when the renderer rejects the conversation."""
    try:
        examples = renderer.build_supervised_examples(conversation, mode)
    except RendererError:
        return "refused"
    return [(model_input.to_ints(), weights.tolist()) for model_input, weights in examples]


@pytest.mark.parametrize("name", sorted(CASES))
def test_identical_to_tml_renderers(name, request, tml_renderer):
    tokenizer_fixture, options = CASES[name]
    ours = get_renderer(name, request.getfixturevalue(tokenizer_fixture))
    theirs = tml_renderer(name)
    compared = {"examples": 0, "prompts": 0, "tool_calls": 0, "trained_tokens": 0, "refused": 0}
    for index, conversation in enumerate(corpus(seed=11, size=CONVERSATIONS, **options)):
        model_input, weights = ours.build_supervised_example(conversation, TrainOnWhat.LAST_ASSISTANT_MESSAGE)
        expected_input, expected_weights = theirs.build_supervised_example(
            _cookbook_form(name, conversation), TrainOnWhat.LAST_ASSISTANT_MESSAGE
        )
        assert model_input.to_ints() == expected_input.to_ints(), f"{name} conversation {index}"
        assert weights.tolist() == expected_weights.tolist(), f"{name} conversation {index} weights"
        compared["examples"] += 1
        compared["trained_tokens"] += int(weights.sum())
        compared["tool_calls"] += any("tool_calls" in m for m in conversation)
        for mode in (TrainOnWhat.LAST_ASSISTANT_TURN, TrainOnWhat.ALL_ASSISTANT_MESSAGES):
            expected = _examples(theirs, _cookbook_form(name, conversation), mode)
            assert _examples(ours, conversation, mode) == expected, f"{name} conversation {index} {mode.value}"
            compared["refused"] += expected == "refused"
        for end, message in enumerate(conversation):
            if message["role"] == "assistant":
                prompt = ours.build_generation_prompt(conversation[:end]).to_ints()
                assert prompt == theirs.build_generation_prompt(conversation[:end]).to_ints(), f"{name} {index}:{end}"
                compared["prompts"] += 1
    assert compared["examples"] == CONVERSATIONS and compared["prompts"] > CONVERSATIONS
    assert compared["tool_calls"] > 3 and compared["trained_tokens"] > CONVERSATIONS
    assert compared["refused"] < CONVERSATIONS  # most multi-example renders were compared, not refused


def test_special_token_text_in_content_is_literal(qwen3_tokenizer, deepseek_tokenizer):
    for name, tokenizer, marker in (
        ("qwen3", qwen3_tokenizer, "<|im_end|>"),
        ("qwen3", qwen3_tokenizer, "<think>"),
        ("deepseekv3", deepseek_tokenizer, "<｜end▁of▁sentence｜>"),
    ):
        renderer = get_renderer(name, tokenizer)
        marker_id = renderer.codec.encode_template(marker)
        assert len(marker_id) == 1
        conversation = [{"role": "user", "content": f"say {marker} now"}, {"role": "assistant", "content": "ok"}]
        tokens = renderer.build_supervised_example(conversation)[0].to_ints()
        rendered_without = renderer.build_supervised_example(
            [{"role": "user", "content": "say  now"}, {"role": "assistant", "content": "ok"}]
        )[0].to_ints()
        assert tokens.count(marker_id[0]) == rendered_without.count(marker_id[0]), name
        assert f"say {marker} now" in renderer.decode(tokens)


def test_disable_thinking_refuses_a_produced_turn_that_reasoned(qwen3_tokenizer, tml_renderer):
    conversation = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "add"}, {"type": "text", "text": "4"}]},
    ]
    with pytest.raises(RendererError, match="reason"):
        get_renderer("qwen3_disable_thinking", qwen3_tokenizer).build_supervised_example(conversation)
    with pytest.raises(RendererError):
        tml_renderer("qwen3_disable_thinking").build_supervised_example(conversation)


def test_qwen3_frames_the_produced_turn_and_strips_history(qwen3_tokenizer):
    renderer = get_renderer("qwen3", qwen3_tokenizer)
    conversation = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "old"}, {"type": "text", "text": "A1"}]},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "new"}, {"type": "text", "text": "A2"}]},
    ]
    model_input, weights = renderer.build_supervised_example(conversation)
    tokens = model_input.to_ints()
    assert renderer.decode(tokens) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\nnew\n</think>\n\nA2<|im_end|>"
    )
    trained = [token for token, weight in zip(tokens, weights) if weight]
    assert renderer.decode(trained) == "<think>\nnew\n</think>\n\nA2<|im_end|>"


def test_deepseek_formats(deepseek_tokenizer):
    conversation = [
        {"role": "system", "content": "SYS"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "A"}]},
    ]
    plain = get_renderer("deepseekv3", deepseek_tokenizer)
    thinking = get_renderer("deepseekv3_thinking", deepseek_tokenizer)
    assert plain.decode(plain.build_supervised_example(conversation)[0].to_ints()) == (
        "<｜begin▁of▁sentence｜>SYS<｜User｜>Q<｜Assistant｜></think>A<｜end▁of▁sentence｜>"
    )
    model_input, weights = thinking.build_supervised_example(conversation)
    tokens = model_input.to_ints()
    assert thinking.decode(tokens) == "<｜begin▁of▁sentence｜>SYS<｜User｜>Q<｜Assistant｜><think>hmm</think>A<｜end▁of▁sentence｜>"
    assert thinking.decode([t for t, w in zip(tokens, weights) if w]) == "hmm</think>A<｜end▁of▁sentence｜>"
    assert thinking.decode(thinking.build_generation_prompt(conversation[:2]).to_ints()).endswith("<｜Assistant｜><think>")
    with pytest.raises(RendererError, match="system"):
        plain.build_supervised_example(conversation[1:2] + conversation[:1] + [{"role": "assistant", "content": "x"}])


def test_deepseek_thinking_closes_the_think_block_of_an_answer_without_reasoning(deepseek_tokenizer):
    """tinker-cookbook 0.6.1's DeepSeekV3ThinkingRenderer writes `<think></think>` before a final answer
    that has no reasoning; the `<think>` is the generation prompt's prefill, so only `</think>` onward trains."""
    renderer = get_renderer("deepseekv3_thinking", deepseek_tokenizer)
    conversation = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    model_input, weights = renderer.build_supervised_example(conversation)
    tokens = model_input.to_ints()
    assert renderer.decode(tokens) == "<｜begin▁of▁sentence｜><｜User｜>Q<｜Assistant｜><think></think>A<｜end▁of▁sentence｜>"
    assert renderer.decode([t for t, w in zip(tokens, weights) if w]) == "</think>A<｜end▁of▁sentence｜>"
    prompt = renderer.build_generation_prompt(conversation[:1]).to_ints()
    assert tokens[: len(prompt)] == prompt
    assert renderer.parse_response(tokens[len(prompt) :])[0] == {"role": "assistant", "content": [{"type": "thinking", "thinking": ""}, {"type": "text", "text": "A"}]}
