"""The chat vocabulary shared by every renderer (tinker-cookbook's names and meanings).

A ``Message`` is a plain dict, so datasets, JSON and parquet rows can be used as they are::

    {"role": "assistant",
     "content": "It is sunny."                      # or a list of parts:
              | [{"type": "thinking", "thinking": "..."}, {"type": "text", "text": "..."}],
     "tool_calls": [{"type": "function", "id": "call_1",
                     "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}],
     "trainable": True}                              # only with TrainOnWhat.CUSTOMIZED
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, NotRequired, TypedDict

Role = str  # "system" | "user" | "assistant" | "tool" (renderers say which they accept)


class TextPart(TypedDict):
    type: Literal["text"]
    text: str


class ThinkingPart(TypedDict):
    type: Literal["thinking"]
    thinking: str


ContentPart = TextPart | ThinkingPart
Content = str | list[ContentPart]


class ToolCallFunction(TypedDict):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's convention)


class ToolCall(TypedDict):
    function: ToolCallFunction
    type: NotRequired[Literal["function"]]
    id: NotRequired[str | None]


class Message(TypedDict):
    role: Role
    content: Content
    tool_calls: NotRequired[list[ToolCall]]
    trainable: NotRequired[bool]
    tool_call_id: NotRequired[str]
    name: NotRequired[str]


class TrainOnWhat(StrEnum):
    """Which tokens of a rendered conversation carry loss (headers only under ``ALL_TOKENS``)."""

    LAST_ASSISTANT_MESSAGE = "last_assistant_message"
    LAST_ASSISTANT_TURN = "last_assistant_turn"  # assistant messages after the last user message
    ALL_ASSISTANT_MESSAGES = "all_assistant_messages"
    ALL_MESSAGES = "all_messages"
    ALL_TOKENS = "all_tokens"
    ALL_USER_AND_SYSTEM_MESSAGES = "all_user_and_system_messages"
    CUSTOMIZED = "customized"  # each message's own ``trainable`` flag


class ParseTermination(StrEnum):
    """How a sampled response ended, as seen by ``Renderer.parse_response``."""

    STOP_SEQUENCE = "stop_sequence"  # the renderer's stop token / string ended it
    EOS = "eos"  # the tokenizer's end-of-sequence token ended it (accepted by some renderers)
    MALFORMED = "malformed"  # truncated, or more than one stop signal

    @property
    def is_clean(self) -> bool:
        return self is not ParseTermination.MALFORMED

    @property
    def is_stop_sequence(self) -> bool:
        return self is ParseTermination.STOP_SEQUENCE


class RendererError(ValueError):
    """A conversation a renderer cannot render faithfully; the message says which and why."""


def text_of(content: Content) -> str:
    """The visible text of a message (thinking parts left out)."""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part["type"] == "text")


def thinking_of(content: Content) -> str | None:
    """The reasoning of a message, or None when it has no thinking part."""
    if isinstance(content, str):
        return None
    parts = [part["thinking"] for part in content if part["type"] == "thinking"]
    return "".join(parts) if parts else None


def validate_message(message: object, where: str) -> Message:
    """Checks the shape of one message; ``where`` names it in the error (e.g. "conversation 3, message 1")."""
    if not isinstance(message, dict):
        raise RendererError(f"{where}: expected a dict with 'role' and 'content', got {type(message).__name__}")
    if not isinstance(message.get("role"), str):
        raise RendererError(f"{where}: missing or non-string 'role' (keys: {sorted(message)})")
    content = message.get("content")
    if isinstance(content, list):
        for index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "thinking") or not isinstance(part.get(kind), str):
                raise RendererError(
                    f"{where}: content part {index} must be {{'type': 'text', 'text': str}} or "
                    f"{{'type': 'thinking', 'thinking': str}}, got {part!r}"
                )
    elif not isinstance(content, str):
        raise RendererError(
            f"{where}: 'content' must be a string or a list of parts, got {type(content).__name__}"
        )
    return message  # type: ignore[return-value]
