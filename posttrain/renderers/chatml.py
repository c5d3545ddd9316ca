"""ChatML, the format of SmolLM2 (the embedded default model): ``<|im_start|>{role}\\n{content}<|im_end|>\\n``.

Every message ends with ``<|im_end|>\\n`` exactly as SmolLM2's own chat template writes it, so a
rendered conversation is token-identical to ``tokenizer.apply_chat_template`` (tested) whenever the
content holds no special-token text (which we encode literally and the template does not). A trained
message is trained up to and including ``<|im_end|>``, its stop token; the ``\\n`` after it stays in the
sequence as context of the next turn but is never a target (the sampler stops before producing it).
``smollm2`` is the same format with the default system prompt SmolLM2's template inserts when a
conversation has none.
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

SMOLLM2_DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class ChatMLRenderer(Renderer):
    prompt_is_rendered_history = True
    name = "chatml"

    def __init__(self, tokenizer: Any, default_system_prompt: str | None = None):
        super().__init__(tokenizer)
        self.default_system_prompt = default_system_prompt
        self._end_token = single_token_id(self.codec, "<|im_end|>", self.name)
        single_token_id(self.codec, "<|im_start|>", self.name)

    def bos_pieces(self) -> list[Piece]:
        return []

    def render_message(self, message: Message, ctx: RenderContext) -> RenderedMessage:
        text = message["content"]
        if not isinstance(text, str) or message.get("tool_calls"):
            raise RendererError(
                f"{self.name} renders plain-text messages only (message {ctx.idx} has thinking parts "
                "or tool calls); use a qwen3 renderer for reasoning and tool use"
            )
        header = [template(f"<|im_start|>{message['role']}\n")]
        if ctx.idx == 0 and self.default_system_prompt is not None and message["role"] != "system":
            header = [template(f"<|im_start|>system\n{self.default_system_prompt}<|im_end|>\n")] + header
        return RenderedMessage(header=header, output=[content(text), template("<|im_end|>")], trailer=[template("\n")])

    def generation_suffix(self, role: str, ctx: RenderContext) -> list[Piece]:
        return [template(f"<|im_start|>{role}\n")]

    def get_stop_sequences(self) -> list[int]:
        return [self._end_token]

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        text, termination = parse_for_stop_token(tokens, self.codec, self._end_token)
        return {"role": "assistant", "content": text}, termination
