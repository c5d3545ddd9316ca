"""Qwen3: ``<|im_start|>{role}\\n{content}<|im_end|>`` joined by ``\\n``, with reasoning and tool calls.

Token-identical to ``tml_renderers.renderers.Qwen3`` (and its ``disable_thinking()`` /
``instruct()`` forms) on the same tokenizer (tested):

- ``qwen3``: the turn being produced (the assistant messages after the last user message) is framed
  ``<think>\\n{reasoning}\\n</think>\\n\\n{answer}``, with an empty block when it did not reason; earlier
  assistant messages lose their reasoning (so the format lacks the extension property).
- ``qwen3_disable_thinking``: the generation prompt ends with the empty block
  ``<think>\\n\\n</think>\\n\\n``, which is therefore never trained; a produced turn that reasoned is
  refused (training it would teach the model to reason after being told not to).
- ``qwen3_instruct`` (Qwen3-2507 Instruct): no framing; reasoning, if any, is plain text
  ``<think>r</think>`` (these models have no reasoning grammar, so it is encoded as ordinary text).
- ``tool`` messages become a ``user`` block of ``<tool_response>\\n...\\n</tool_response>``, consecutive
  ones sharing a block; ``tool_calls`` become ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Not reproduced: tml-renderers merges consecutive user (or system) messages into one block with no
separator; we render each as its own block, as Qwen's chat template does.
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
from posttrain.renderers.types import (
    Message,
    ParseTermination,
    RendererError,
    ToolCall,
    text_of,
    thinking_of,
)

EMPTY_THINK_BLOCK = "<think>\n\n</think>\n\n"


def tool_call_json(call: ToolCall, where: str) -> dict[str, Any]:
    """``{"name", "arguments": object}`` of an OpenAI-style tool call; clear errors for bad ones."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RendererError(f"{where}: a tool call needs {{'function': {{'name': str, 'arguments': str}}}}, got {call!r}")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            raise RendererError(f"{where}: tool call {function['name']!r} arguments are not JSON: {error}") from error
    if not isinstance(arguments, dict):
        raise RendererError(f"{where}: tool call {function['name']!r} arguments must be a JSON object")
    return {"name": function["name"], "arguments": arguments}


class Qwen3Renderer(Renderer):
    name = "qwen3"
    frames_thinking = True
    disables_thinking = False

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        self._end_token = single_token_id(self.codec, "<|im_end|>", self.name)
        single_token_id(self.codec, "<|im_start|>", self.name)
        self._markers = {
            marker: single_token_id(self.codec, marker, self.name)
            for marker in ("<think>", "</think>", "<tool_call>", "</tool_call>")
        }

    @property
    def has_extension_property(self) -> bool:
        return False

    def render_message(self, message: Message, ctx: RenderContext) -> RenderedMessage:
        role = message["role"]
        separator = "\n" if ctx.idx > 0 else ""
        if role == "tool":
            return self._render_tool(message, ctx, separator)
        header = [template(f"{separator}<|im_start|>{role}\n")]
        if role != "assistant":
            return RenderedMessage(header, [content(text_of(message["content"])), template("<|im_end|>")])
        return RenderedMessage(header, self._assistant_output(message, ctx) + [template("<|im_end|>")])

    def _render_tool(self, message: Message, ctx: RenderContext, separator: str) -> RenderedMessage:
        after_tool = ctx.prev_message is not None and ctx.prev_message["role"] == "tool"
        before_tool = ctx.next_message is not None and ctx.next_message["role"] == "tool"
        header = [template("\n" if after_tool else f"{separator}<|im_start|>user\n")]
        output = [
            template("<tool_response>"),
            content("\n" + text_of(message["content"]) + "\n"),
            template("</tool_response>" if before_tool else "</tool_response><|im_end|>"),
        ]
        return RenderedMessage(header, output)

    def _assistant_output(self, message: Message, ctx: RenderContext) -> list[Piece]:
        text = text_of(message["content"])
        reasoning = thinking_of(message["content"])
        in_produced_turn = ctx.idx >= ctx.produced_turn_start
        framed = self.frames_thinking and in_produced_turn and ctx.last_user_index >= 0
        # tml-renderers encodes the produced message part by part, but a history message as one text
        # (all ordinary text between two special tokens together); token boundaries differ, so must we.
        produced = ctx.is_last and not ctx.in_prompt
        if framed:
            pieces = [template("<think>"), content("\n" + (reasoning or "").strip("\n") + "\n"), template("</think>")]
            texts = ["\n\n", text.lstrip("\n")]
        else:
            pieces = []
            shown = "<think>" + reasoning.strip("\n") + "</think>" if reasoning is not None and in_produced_turn else ""
            texts = [shown, text]
        calls = message.get("tool_calls") or []
        if calls and texts[-1] or (calls and not framed and texts[0]):
            texts.append("\n")
        pieces += [content(part) for part in texts] if produced else [content("".join(texts))]
        for index, call in enumerate(calls):
            payload = json.dumps(tool_call_json(call, f"{self.name} message {ctx.idx}"), ensure_ascii=False)
            opening = "<tool_call>" if index == 0 else "\n<tool_call>"
            pieces += [template(opening), content("\n" + payload + "\n"), template("</tool_call>")]
        return pieces

    def generation_suffix(self, role: str, ctx: RenderContext) -> list[Piece]:
        separator = "\n" if ctx.idx > 0 else ""
        return [template(f"{separator}<|im_start|>{role}\n")]

    def get_stop_sequences(self) -> list[int]:
        return [self._end_token]

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        """Parses at the token level, so text that merely spells ``<think>`` or ``<tool_call>`` (encoded
        literally) is never mistaken for structure. ``qwen3_instruct`` has no reasoning grammar: its
        output is text (and tool calls)."""
        tokens = list(tokens)
        _, termination = parse_for_stop_token(tokens, self.codec, self._end_token)
        if self._end_token in tokens:
            tokens = tokens[: tokens.index(self._end_token)]
        think, end_think = self._markers["<think>"], self._markers["</think>"]
        reasoning = None
        if self.frames_thinking and tokens[:1] == [think] and end_think in tokens:
            close = tokens.index(end_think)
            reasoning = self.codec.decode(tokens[1:close]).strip("\n")
            tokens = tokens[close + 1 :]
        text, calls, malformed_call = self._split_tool_calls(tokens)
        if reasoning is not None:
            text = text.lstrip("\n")
        message: Message = {"role": "assistant", "content": text}
        if reasoning:  # an empty block means the turn did not reason
            message["content"] = [{"type": "thinking", "thinking": reasoning}] + (
                [{"type": "text", "text": text}] if text else []
            )
        if calls:
            message["tool_calls"] = calls
        if malformed_call and termination.is_clean:
            termination = ParseTermination.MALFORMED
        return message, termination

    def _split_tool_calls(self, tokens: list[int]) -> tuple[str, list[ToolCall], bool]:
        open_call, close_call = self._markers["<tool_call>"], self._markers["</tool_call>"]
        if open_call not in tokens:
            return self.codec.decode(tokens), [], False
        first = tokens.index(open_call)
        text = self.codec.decode(tokens[:first]).removesuffix("\n")
        calls: list[ToolCall] = []
        position = first
        while position < len(tokens) and tokens[position] == open_call:
            if close_call not in tokens[position:]:
                return text, calls, True
            close = tokens.index(close_call, position)
            try:
                payload = json.loads(self.codec.decode(tokens[position + 1 : close]))
                arguments = json.dumps(payload["arguments"])
                calls.append({"type": "function", "function": {"name": payload["name"], "arguments": arguments}})
            except (json.JSONDecodeError, KeyError, TypeError):
                return text, calls, True
            position = close + 1
            if self.codec.decode(tokens[position : position + 1]) == "\n":
                position += 1
        return text, calls, position < len(tokens)


class Qwen3DisableThinkingRenderer(Qwen3Renderer):
    name = "qwen3_disable_thinking"
    disables_thinking = True

    def generation_suffix(self, role: str, ctx: RenderContext) -> list[Piece]:
        suffix = super().generation_suffix(role, ctx)
        return suffix + [template(EMPTY_THINK_BLOCK)] if role == "assistant" else suffix

    def on_prompt_mismatch(self, messages: Sequence[Message]) -> None:
        raise RendererError(
            f"{self.name}: the final assistant turn does not start with the empty think block its "
            "generation prompt ends with (it carries reasoning, or there is no user message before "
            "it). Training it would teach the model to reason after being told not to: use 'qwen3', "
            "or drop the reasoning from that turn."
        )


class Qwen3InstructRenderer(Qwen3Renderer):
    name = "qwen3_instruct"
    frames_thinking = False
