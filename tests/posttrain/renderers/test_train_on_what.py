"""Every TrainOnWhat value, the trainable flag, and the simple formats (role_colon, llama3)."""

from __future__ import annotations

import json

import pytest

from posttrain.renderers import ParseTermination, RendererError, TrainOnWhat, get_renderer, renderer_names

CONVERSATION = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "U2"},
    {"role": "assistant", "content": "A2"},
    {"role": "assistant", "content": "A3"},
]
EXPECTED_TRAINED_TEXT = {  # each message up to its stop token; the newline after <|im_end|> is never trained
    TrainOnWhat.LAST_ASSISTANT_MESSAGE: "A3<|im_end|>",
    TrainOnWhat.LAST_ASSISTANT_TURN: "A2<|im_end|>A3<|im_end|>",
    TrainOnWhat.ALL_ASSISTANT_MESSAGES: "A1<|im_end|>A2<|im_end|>A3<|im_end|>",
    TrainOnWhat.ALL_MESSAGES: "S<|im_end|>U1<|im_end|>A1<|im_end|>U2<|im_end|>A2<|im_end|>A3<|im_end|>",
    TrainOnWhat.ALL_USER_AND_SYSTEM_MESSAGES: "S<|im_end|>U1<|im_end|>U2<|im_end|>",
}


def _trained_text(renderer, messages, train_on_what) -> str:
    model_input, weights = renderer.build_supervised_example(messages, train_on_what)
    return renderer.decode([token for token, weight in zip(model_input.to_ints(), weights) if weight])


@pytest.mark.parametrize("train_on_what", sorted(EXPECTED_TRAINED_TEXT))
def test_each_mode_trains_its_messages(smollm2_tokenizer, train_on_what):
    renderer = get_renderer("chatml", smollm2_tokenizer)
    assert _trained_text(renderer, CONVERSATION, train_on_what) == EXPECTED_TRAINED_TEXT[train_on_what]


def test_all_tokens_trains_headers_too(smollm2_tokenizer):
    renderer = get_renderer("chatml", smollm2_tokenizer)
    model_input, weights = renderer.build_supervised_example(CONVERSATION, TrainOnWhat.ALL_TOKENS)
    assert weights.min() == 1.0 and len(weights) == model_input.length


def test_customized_follows_each_flag(smollm2_tokenizer):
    renderer = get_renderer("chatml", smollm2_tokenizer)
    flagged = [dict(message, trainable=message["content"] in ("U2", "A1")) for message in CONVERSATION]
    assert _trained_text(renderer, flagged, TrainOnWhat.CUSTOMIZED) == "A1<|im_end|>U2<|im_end|>"
    with pytest.raises(RendererError, match="message 0 .* no 'trainable' flag"):
        renderer.build_supervised_example(CONVERSATION, TrainOnWhat.CUSTOMIZED)
    with pytest.raises(RendererError, match="has a 'trainable' flag but train_on_what is last_assistant_message"):
        renderer.build_supervised_example(flagged)


def test_string_modes_and_unknown_mode(smollm2_tokenizer):
    renderer = get_renderer("chatml", smollm2_tokenizer)
    assert _trained_text(renderer, CONVERSATION, "last_assistant_message") == "A3<|im_end|>"
    with pytest.raises(ValueError, match="everything"):
        renderer.build_supervised_example(CONVERSATION, "everything")


def test_role_colon_format_stop_overlap_and_terminations(smollm2_tokenizer):
    renderer = get_renderer("role_colon", smollm2_tokenizer)
    conversation = [{"role": "system", "content": "SYS"}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    model_input, weights = renderer.build_supervised_example(conversation)
    bos = smollm2_tokenizer.bos_token
    assert renderer.decode(model_input.to_ints()) == f"{bos}System: SYS\n\nUser: Hi\n\nAssistant: Hello!\n\nUser:"
    assert _trained_text(renderer, conversation, TrainOnWhat.LAST_ASSISTANT_MESSAGE) == " Hello!\n\nUser:"
    prompt = renderer.build_generation_prompt(conversation[:2], prefill=" Sure")
    assert renderer.decode(prompt.to_ints()) == f"{bos}System: SYS\n\nUser: Hi\n\nAssistant: Sure"
    assert renderer.get_stop_sequences() == ["\n\nUser:"]
    encode = lambda text: smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert renderer.parse_response(encode(" Hello!\n\nUser:")) == ({"role": "assistant", "content": "Hello!"}, ParseTermination.STOP_SEQUENCE)
    eos = smollm2_tokenizer.eos_token_id
    assert renderer.parse_response(encode(" Hello!") + [eos])[1] == ParseTermination.EOS
    assert renderer.parse_response(encode(" Hello! and"))[1] == ParseTermination.MALFORMED


def test_llama3_format(llama3_like_tokenizer, smollm2_tokenizer):
    renderer = get_renderer("llama3", llama3_like_tokenizer)
    conversation = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi <|eot_id|>"}, {"role": "assistant", "content": "Yo"}]
    model_input, _ = renderer.build_supervised_example(conversation)
    assert renderer.decode(model_input.to_ints()) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi <|eot_id|><|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nYo<|eot_id|>"
    )
    eot = llama3_like_tokenizer.token_to_id("<|eot_id|>")
    assert model_input.to_ints().count(eot) == 3  # the one in the user's text stayed text
    assert renderer.get_stop_sequences() == [eot]
    with pytest.raises(ValueError, match="llama3.*<\\|eot_id\\|>.*single token"):
        get_renderer("llama3", smollm2_tokenizer)


def test_registry_names_and_errors(smollm2_tokenizer):
    names = renderer_names()
    for name in ("role_colon", "llama3", "chatml", "qwen3", "qwen3_disable_thinking", "qwen3_instruct", "deepseekv3", "deepseekv3_thinking", "tml:kimi_k2"):
        assert name in names
    with pytest.raises(RendererError, match="unknown renderer 'qwen4'.*chatml.*tml:kimi_k2"):
        get_renderer("qwen4", smollm2_tokenizer)
    with pytest.raises(RendererError, match="unknown renderer 'tml:nope'"):
        get_renderer("tml:nope")
    with pytest.raises(RendererError, match="needs a tokenizer"):
        get_renderer("chatml")
    with pytest.raises(RendererError, match="thinking parts or tool calls"):
        get_renderer("chatml", smollm2_tokenizer).build_generation_prompt(
            [{"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": json.dumps({})}}]}]
        )
