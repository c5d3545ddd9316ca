"""`renderer: auto` picks the base model's recommended renderer per family, and tool calls in chat data
survive normalization, the table and rendering where the format has them (qwen3, llama3, deepseekv3)."""

from __future__ import annotations

import json

import pytest

from posttrain.datasets import schemas, tokens
from posttrain.datasets.loaders import LoadSpec, load
from posttrain.datasets.rows import BadRowError
from posttrain.renderers import RendererError, get_renderer, resolve_renderer_name
from posttrain.renderers.model_info import recommended_renderer

FAMILIES = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": "chatml",
    "localtinker/tiny-random": "chatml",
    "meta-llama/Llama-3.2-1B-Instruct": "llama3",
    "meta-llama/Llama-3.1-8B-Instruct": "llama3",
    "meta-llama/Llama-3.2-1B": "role_colon",
    "Qwen/Qwen3-8B": "qwen3",
    "Qwen/Qwen3-30B-A3B-Instruct-2507": "qwen3_instruct",
    "Qwen/Qwen3-8B-Base": "role_colon",
    "Qwen/Qwen3.5-4B": "tml:qwen3_5",
    "deepseek-ai/DeepSeek-V3.1": "deepseekv3",
    "deepseek-ai/DeepSeek-V3.1-Base": "role_colon",
    "openai/gpt-oss-20b": "tml:gpt_oss_medium",
    "moonshotai/Kimi-K2-Thinking": "tml:kimi_k2",
}

TOOL_CHAT = {
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny in Paris."},
    ]
}


@pytest.mark.parametrize("base_model,expected", FAMILIES.items())
def test_each_family_gets_its_recommended_renderer(base_model, expected):
    assert recommended_renderer(base_model) == expected
    assert resolve_renderer_name("auto", base_model) == expected
    assert resolve_renderer_name("role_colon", base_model) == "role_colon"  # a named renderer overrides


def test_auto_builds_the_family_renderer_and_records_its_real_name(smollm2_tokenizer, qwen3_tokenizer, deepseek_tokenizer, llama3_like_tokenizer):
    assert get_renderer("auto", smollm2_tokenizer, base_model="HuggingFaceTB/SmolLM2-135M-Instruct").name == "chatml"
    assert get_renderer("auto", qwen3_tokenizer, base_model="Qwen/Qwen3-8B").name == "qwen3"
    assert get_renderer("auto", deepseek_tokenizer, base_model="deepseek-ai/DeepSeek-V3.1").name == "deepseekv3"
    # A base model named by a local path: the tokenizer's control tokens tell the family.
    for tokenizer, expected in ((smollm2_tokenizer, "chatml"), (qwen3_tokenizer, "qwen3"),
                                (deepseek_tokenizer, "deepseekv3"), (llama3_like_tokenizer, "llama3")):
        assert get_renderer("auto", tokenizer, base_model="/models/my-finetune").name == expected


def test_auto_without_a_known_family_says_how_to_choose():
    with pytest.raises(RendererError, match="cannot tell the chat format of base model 'acme/mystery-7b'; set renderer to one of: .*chatml"):
        resolve_renderer_name("auto", "acme/mystery-7b")


@pytest.fixture
def tool_table(write_jsonl):
    table = load(LoadSpec("chat", str(write_jsonl([TOOL_CHAT, {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}])))).table
    assert table.schema.field("messages").type == schemas.TOOL_MESSAGES
    assert not schemas.schema_problems(table, schemas.CHAT)
    return table


def test_tool_calls_survive_normalization_into_the_table(tool_table):
    messages = tool_table.to_pylist()[0]["messages"]
    assert messages[1]["content"] == "" and messages[1]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    ]
    assert messages[2]["tool_call_id"] == "call_1"
    plain = load(LoadSpec("chat", "reasoning_gym:chain_sum", limit=2)).table
    assert plain.schema.field("messages").type == schemas.MESSAGES  # tables without tools keep their schema


def _rendered_text(renderer, table) -> str:
    rendered = tokens.render_chat_table(table, renderer, "all_assistant_messages", None)
    row = rendered.to_pylist()[0]
    return renderer.decode(row["model_input"] + row["target_tokens"][-1:])


def test_qwen3_renders_tool_calls_as_tool_call_json(tool_table, qwen3_tokenizer):
    text = _rendered_text(get_renderer("qwen3", qwen3_tokenizer), tool_table)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


def test_llama3_renders_tool_calls_as_name_and_parameters(tool_table, llama3_like_tokenizer):
    renderer = get_renderer("llama3", llama3_like_tokenizer)
    text = _rendered_text(renderer, tool_table)
    assert '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "sunny, 21 C"}<|eot_id|>' in text
    sampled = llama3_like_tokenizer.encode('Checking. {"name": "get_weather", "parameters": {"city": "Oslo"}}', add_special_tokens=False).ids
    message, _ = renderer.parse_response(sampled + [llama3_like_tokenizer.token_to_id("<|eot_id|>")])
    assert message["content"] == "Checking."
    assert message["tool_calls"] == [{"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}]


def test_deepseek_renders_tool_calls_with_its_markers(tool_table, deepseek_tokenizer):
    text = _rendered_text(get_renderer("deepseekv3", deepseek_tokenizer), tool_table)
    assert "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" in text and "<｜tool▁output▁begin｜>sunny, 21 C<｜tool▁output▁end｜>" in text


def test_a_renderer_without_tool_calls_names_the_row_and_the_fix(tool_table, smollm2_tokenizer):
    with pytest.raises(BadRowError, match=r"line1: cannot be rendered: .*tool calls.*qwen3"):
        tokens.render_chat_table(tool_table, get_renderer("chatml", smollm2_tokenizer), "all_assistant_messages", None)
