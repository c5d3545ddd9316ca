"""Llama 3: ``<|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>``.

Like the cookbook, no "Cutting Knowledge Date" preamble and no tool calling (Llama 3's bare-JSON tool
calls cannot be told apart from JSON answers).
"""

from __future__ import annotations

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
from posttrain.renderers.types import Message, ParseTermination, RendererError


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
        if not isinstance(text, str) or message.get("tool_calls"):
            raise RendererError(f"{self.name} renders plain-text messages only (message {ctx.idx})")
        return RenderedMessage(
            header=[template(f"<|start_header_id|>{message['role']}<|end_header_id|>\n\n")],
            output=[content(text), template("<|eot_id|>")],
        )

    def get_stop_sequences(self) -> list[int]:
        return [self._end_token]

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        text, termination = parse_for_stop_token(tokens, self.codec, self._end_token)
        return {"role": "assistant", "content": text}, termination
