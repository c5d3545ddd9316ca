"""DeepSeek V3(.1): ``<｜begin▁of▁sentence｜>{system}<｜User｜>{q}<｜Assistant｜></think>{a}<｜end▁of▁sentence｜>``.

(｜ is U+FF5C, ▁ is U+2581.) Token-identical to ``tml_renderers.renderers.DeepSeekV31()`` and
``DeepSeekV31.thinking()`` on DeepSeek V3.1's tokenizer (tested):

- ``deepseekv3`` (non-thinking): every assistant message after a user message opens with
  ``<｜Assistant｜></think>``; reasoning is dropped everywhere.
- ``deepseekv3_thinking``: the generation prompt after a user message ends ``<｜Assistant｜><think>``
  and the produced (final) message continues ``{reasoning}</think>{answer}`` (``</think>{answer}`` when
  a non-empty answer has no reasoning: an empty ``<think></think>`` block, as tinker-cookbook 0.6.1 and
  tml-renderers write it); every other message,
  including the history of a generation prompt, loses its reasoning and opens with ``</think>``. A produced message that is not preceded by a user message
  (after a tool result) writes the whole ``<think>{reasoning}</think>`` block itself.
- System prompts come first, joined by a blank line, before any user message (a system message later
  in the conversation is refused: DeepSeek hoists it, which would reorder the conversation).
- Tool calls: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>
  ...<｜tool▁calls▁end｜><｜end▁of▁sentence｜>``, after the text's own end-of-sentence when there is
  text (as tml-renderers writes it); tool results ``<｜tool▁output▁begin｜>{result}<｜tool▁output▁end｜>``.
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
    template,
)
from posttrain.renderers.codec import single_token_id
from posttrain.renderers.qwen3 import tool_call_json
from posttrain.renderers.types import (
    Message,
    ParseTermination,
    RendererError,
    ToolCall,
    text_of,
    thinking_of,
)

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"


class DeepSeekV3Renderer(Renderer):
    name = "deepseekv3"
    thinking = False
    merges_extending_examples = True

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        self._end_token = single_token_id(self.codec, EOS, self.name)
        for marker in (BOS, USER, ASSISTANT, OUTPUT_BEGIN):
            single_token_id(self.codec, marker, self.name)
        self._ids = {
            marker: single_token_id(self.codec, marker, self.name)
            for marker in ("<think>", "</think>", CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_SEP, CALL_END)
        }

    @property
    def has_extension_property(self) -> bool:
        return False

    def bos_pieces(self) -> list[Piece]:
        return [template(BOS)]

    def prepare(self, messages: list[Message]) -> list[Message]:
        """Leading system messages become one, joined by a blank line (DeepSeek encodes them as one text)."""
        leading = 0
        while leading < len(messages) and messages[leading]["role"] == "system":
            leading += 1
        if leading < 2:
            return messages
        flags = {message.get("trainable") for message in messages[:leading]}
        if len(flags) > 1:
            raise RendererError(f"{self.name}: the leading system messages disagree on 'trainable'; they render as one text")
        merged: Message = {"role": "system", "content": "\n\n".join(text_of(m["content"]) for m in messages[:leading])}
        if "trainable" in messages[0]:
            merged["trainable"] = messages[0]["trainable"]
        return [merged, *messages[leading:]]

    def render_message(self, message: Message, ctx: RenderContext) -> RenderedMessage:
        role = message["role"]
        text = text_of(message["content"])
        if role == "system":
            if ctx.prev_message is not None and ctx.prev_message["role"] != "system":
                raise RendererError(
                    f"{self.name}: message {ctx.idx} is a system message after the conversation "
                    "started; DeepSeek V3 only takes system prompts at the start (merge it into the "
                    "first system message or make it a user message)"
                )
            return RenderedMessage([], [content(text)])
        if role == "user":
            return RenderedMessage([template(USER)], [content(text)])
        if role == "tool":
            return RenderedMessage([], [template(OUTPUT_BEGIN), content(text), template(OUTPUT_END)])
        if role != "assistant":
            raise RendererError(f"{self.name}: message {ctx.idx} has role {role!r}; expected system, user, assistant or tool")
        return self._render_assistant(message, ctx, text)

    def _render_assistant(self, message: Message, ctx: RenderContext, text: str) -> RenderedMessage:
        after_user = ctx.prev_message is not None and ctx.prev_message["role"] == "user"
        produced = self.thinking and ctx.is_last and not ctx.in_prompt
        header = [template(ASSISTANT + ("<think>" if produced else "</think>"))] if after_user else []
        output: list[Piece] = []
        reasoning = thinking_of(message["content"])
        if produced and reasoning is not None:
            output += [] if after_user else [template("<think>")]
            output += [content(reasoning), template("</think>")]
        elif produced and after_user and text:
            output.append(template("</think>"))  # close the prefilled <think>: an empty block, as cookbook 0.6.1
        calls = message.get("tool_calls") or []
        if text or not calls:
            output += [content(text), template(EOS)]
        if calls:
            output.append(template(CALLS_BEGIN))
            for call in calls:
                payload = tool_call_json(call, f"{self.name} message {ctx.idx}")
                output += [
                    template(CALL_BEGIN),
                    content(payload["name"]),
                    template(CALL_SEP),
                    content(json.dumps(payload["arguments"])),
                    template(CALL_END),
                ]
            output.append(template(CALLS_END + EOS))
        return RenderedMessage(header, output)

    def generation_suffix(self, role: str, ctx: RenderContext) -> list[Piece]:
        if role != "assistant":
            raise RendererError(f"{self.name} can only prompt for an assistant message, not {role!r}")
        if ctx.prev_message is None or ctx.prev_message["role"] != "user":
            return []
        return [template(ASSISTANT + ("<think>" if self.thinking else "</think>"))]

    def get_stop_sequences(self) -> list[int]:
        return [self._end_token]

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        """Parses at the token level (literal marker text in content is not structure). A turn ends at
        its first end-of-sentence, or its second when a tool-call block follows the text."""
        tokens = list(tokens)
        if self._end_token not in tokens:
            return self._parse_text(tokens), ParseTermination.MALFORMED
        end = tokens.index(self._end_token)
        text, rest = tokens[:end], tokens[end + 1 :]
        if text[:1] == [self._ids[CALLS_BEGIN]]:
            text, rest = [], text + [self._end_token] + rest
        message = self._parse_text(text)
        clean = not rest
        if rest[:1] == [self._ids[CALLS_BEGIN]] and self._end_token in rest:
            close = rest.index(self._end_token)
            calls, clean = self._parse_calls(rest[1:close]), close == len(rest) - 1
            if calls:
                message["tool_calls"] = calls
            else:
                clean = False
        return message, ParseTermination.STOP_SEQUENCE if clean else ParseTermination.MALFORMED

    def _parse_text(self, tokens: list[int]) -> Message:
        reasoning = None
        if self.thinking and self._ids["</think>"] in tokens:
            close = tokens.index(self._ids["</think>"])
            start = 1 if tokens[:1] == [self._ids["<think>"]] else 0
            reasoning, tokens = self.codec.decode(tokens[start:close]), tokens[close + 1 :]
        text = self.codec.decode(tokens)
        message: Message = {"role": "assistant", "content": text}
        if reasoning is not None:
            message["content"] = [{"type": "thinking", "thinking": reasoning}] + (
                [{"type": "text", "text": text}] if text else []
            )
        return message

    def _parse_calls(self, tokens: list[int]) -> list[ToolCall]:
        """``call_begin name sep arguments call_end`` repeated, up to ``calls_end``."""
        begin, sep, end = self._ids[CALL_BEGIN], self._ids[CALL_SEP], self._ids[CALL_END]
        calls: list[ToolCall] = []
        position = 0
        while position < len(tokens) and tokens[position] == begin:
            try:
                middle = tokens.index(sep, position)
                close = tokens.index(end, middle)
                arguments = json.loads(self.codec.decode(tokens[middle + 1 : close]))
            except (ValueError, json.JSONDecodeError):
                return []
            name = self.codec.decode(tokens[position + 1 : middle])
            calls.append({"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}})
            position = close + 1
        return calls if tokens[position:] == [self._ids[CALLS_END]] else []


class DeepSeekV3ThinkingRenderer(DeepSeekV3Renderer):
    name = "deepseekv3_thinking"
    thinking = True
