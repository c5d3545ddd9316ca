"""Llama 3: ``<|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>``.

Like the cookbook, no "Cutting Knowledge Date" preamble. Tool calls follow the cookbook's Llama 3 format:
each call is appended to the assistant's text as ``{"name": ..., "parameters": {...}}`` (arguments
encoded once, not twice as HF's template does); a tool result is an ``ipython`` message holding
``{"output": <result>}``. Parsing reads back JSON objects with a name and parameters as tool calls:
in this format a JSON answer of that shape *is* a call.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from posttrain.renderers.base import (
    Piece,
    RenderContext,
    RenderedMessage,
    Renderer,
    content,
    parse_for_stop_token,
    template,
)
from posttrain.renderers.codec import single_token_id
from posttrain.renderers.qwen3 import tool_call_json
from posttrain.renderers.types import Message, ParseTermination, RendererError, ToolCall


class Llama3Renderer(Renderer):
    prompt_is_rendered_history = True
    name = "llama3"

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        self._end_token = single_token_id(self.codec, "<|eot_id|>", self.name)
        single_token_id(self.codec, "<|begin_of_text|>", self.name)

    def bos_pieces(self) -> list[Piece]:
        return [template("<|begin_of_text|>")]

    def render_message(self, message: Message, ctx: RenderContext) -> RenderedMessage:
        text = message["content"]
        if not isinstance(text, str):
            raise RendererError(f"{self.name} renders text content only, not content parts (message {ctx.idx})")
        role = message["role"]
        if role == "tool":
            role, text = "ipython", json.dumps({"output": text}, ensure_ascii=False)
        for call in message.get("tool_calls") or []:
            payload = tool_call_json(call, f"{self.name} message {ctx.idx}")
            text += json.dumps({"name": payload["name"], "parameters": payload["arguments"]}, ensure_ascii=False)
        return RenderedMessage(
            header=[template(f"<|start_header_id|>{role}<|end_header_id|>\n\n")],
            output=[content(text), template("<|eot_id|>")],
        )

    def get_stop_sequences(self) -> list[int]:
        return [self._end_token]

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        text, termination = parse_for_stop_token(tokens, self.codec, self._end_token)
        remaining, calls = _split_tool_calls(text)
        if not calls:
            return {"role": "assistant", "content": text}, termination
        return {"role": "assistant", "content": remaining, "tool_calls": calls}, termination


def _split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The text without its ``{"name", "parameters"}`` JSON objects, and those objects as tool calls."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    kept, position = [], 0
    while (start := text.find("{", position)) >= 0:
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            kept.append(text[position : start + 1])
            position = start + 1
            continue
        arguments = value.get("parameters", value.get("arguments")) if isinstance(value, dict) else None
        if isinstance(value.get("name") if isinstance(value, dict) else None, str) and isinstance(arguments, dict):
            kept.append(text[position:start])
            calls.append({"type": "function", "function": {"name": value["name"], "arguments": json.dumps(arguments)}})
        else:
            kept.append(text[position:end])
        position = end
    kept.append(text[position:])
    return "".join(kept).strip(), calls
