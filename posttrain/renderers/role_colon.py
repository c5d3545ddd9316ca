"""``System: ...\\n\\nUser: ...\\n\\nAssistant: ...`` for base models with no chat template.

Each message is a header ``Role:`` and an output `` {content}\\n\\n``; a turn ends with the stop
string ``\\n\\nUser:``, whose ``User:`` half is trained after the final message only (it is the next
message's header otherwise). Starts with the tokenizer's BOS token when it has one (cookbook 0.6.1).
"""

from __future__ import annotations

from collections.abc import Sequence

from posttrain.renderers.base import Piece, RenderContext, RenderedMessage, Renderer, content, template
from posttrain.renderers.types import Message, ParseTermination, RendererError

_STOP = "\n\nUser:"


class RoleColonRenderer(Renderer):
    prompt_is_rendered_history = True
    name = "role_colon"

    def bos_pieces(self) -> list[Piece]:
        bos = self.codec.bos_text
        return [template(bos)] if bos else []

    def render_message(self, message: Message, ctx: RenderContext) -> RenderedMessage:
        text = message["content"]
        if not isinstance(text, str) or message.get("tool_calls"):
            raise RendererError(f"{self.name} renders plain-text messages only (message {ctx.idx})")
        overlap = [template("User:")] if message["role"] == "assistant" else []
        return RenderedMessage(
            header=[template(message["role"].capitalize() + ":")],
            output=[content(" " + text + "\n\n")],
            stop_overlap=overlap,
        )

    def get_stop_sequences(self) -> list[str]:
        return [_STOP]

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        tokens = list(tokens)
        eos = self.codec.eos_token_id
        ended_with_eos = eos is not None and bool(tokens) and tokens[-1] == eos
        if ended_with_eos:
            tokens = tokens[:-1]
        pieces = self.codec.decode(tokens).split(_STOP)
        text = pieces[0].removeprefix(" ").removesuffix("\n\n")
        message: Message = {"role": "assistant", "content": text}
        if len(pieces) == 2 and not ended_with_eos:
            return message, ParseTermination.STOP_SEQUENCE
        if len(pieces) == 1 and ended_with_eos:
            return message, ParseTermination.EOS
        return message, ParseTermination.MALFORMED
