"""Row-level validation: every bad row is either a clear error or a counted, sampled skip.

A row's `where` is a human-readable location ("data/chat.jsonl line 7", "HuggingFaceH4/no_robots
[train] row 12") so an error message points at the exact input to fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
MAX_SKIP_SAMPLES = 5


class BadRowError(ValueError):
    """One input row cannot be used; the message names where it is and what is wrong."""

    def __init__(self, where: str, problem: str):
        self.where = where
        self.problem = problem
        super().__init__(f"{where}: {problem}")


class EmptyDatasetError(ValueError):
    """Nothing usable was loaded; training on zero rows would succeed silently and learn nothing."""


@dataclass
class SkipLog:
    """Bad rows skipped under `skip_bad_rows=True`: how many, and a few samples to show the user."""

    skip_bad_rows: bool = False
    count: int = 0
    samples: list[str] = field(default_factory=list)

    def reject(self, error: BadRowError) -> None:
        """Raise the error, or record it when skipping is allowed."""
        if not self.skip_bad_rows:
            raise error
        self.record(str(error))

    def record(self, description: str) -> None:
        """Count one dropped row, keeping the first few descriptions as samples."""
        self.count += 1
        if len(self.samples) < MAX_SKIP_SAMPLES:
            self.samples.append(description)


def normalize_message(value: Any, where: str) -> dict[str, Any]:
    """Check one message: a mapping with a known string `role` and a string `content`, keeping tool calls
    (OpenAI's shape: ``tool_calls: [{id?, type?, function: {name, arguments}}]``, arguments as JSON text)
    and a tool result's ``tool_call_id`` / ``name``. An assistant message that only calls tools may have
    null content (OpenAI's convention); it becomes ""."""
    if not isinstance(value, dict):
        raise BadRowError(where, f"message is {type(value).__name__}, expected an object with role and content")
    role = value.get("role")
    if role is None:
        raise BadRowError(where, "message has no 'role' (expected one of " + ", ".join(sorted(ROLES)) + ")")
    if not isinstance(role, str) or role not in ROLES:
        raise BadRowError(where, f"unknown role {role!r} (expected one of {', '.join(sorted(ROLES))})")
    tool_calls = [_tool_call(call, f"{where} tool call {i}") for i, call in enumerate(value.get("tool_calls") or [])]
    content = value.get("content")
    if content is None and tool_calls:
        content = ""
    if content is None:
        raise BadRowError(where, f"{role} message has no 'content'")
    if not isinstance(content, str):
        raise BadRowError(
            where, f"{role} message content is {type(content).__name__}, expected a string"
        )
    message: dict[str, Any] = {"role": role, "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    for key in ("tool_call_id", "name"):
        if isinstance(value.get(key), str) and value[key]:
            message[key] = value[key]
    return message


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """One tool call in OpenAI's shape, its arguments as JSON text (a mapping is serialized)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise BadRowError(where, f"expected {{'function': {{'name': str, 'arguments': ...}}}}, got {call!r}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise BadRowError(where, f"arguments of {function['name']!r} are {type(arguments).__name__}, expected a JSON object")
    found: dict[str, Any] = {"type": call.get("type") or "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        found["id"] = call["id"]
    return found


def compact_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages read back from a table with tool fields, without the null fields Arrow fills in for messages
    that have none (renderers test for a key's presence)."""
    return [_without_nulls(message) for message in messages]


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def normalize_messages(value: Any, where: str, *, need_assistant: bool = True) -> list[dict[str, Any]]:
    """Check a conversation: a non-empty list of valid messages, ending usable for training."""
    if not isinstance(value, list) or not value:
        raise BadRowError(where, "messages must be a non-empty list of {role, content} objects")
    messages = [normalize_message(m, f"{where} message {i}") for i, m in enumerate(value)]
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise BadRowError(where, "conversation has no assistant message, so nothing would be trained")
    return messages


def require_string(record: dict, column: str, where: str) -> str:
    """A required non-empty string column of a raw record."""
    if column not in record:
        raise BadRowError(where, f"missing column {column!r} (columns present: {sorted(record)})")
    value = record[column]
    if not isinstance(value, str):
        raise BadRowError(where, f"column {column!r} is {type(value).__name__}, expected a string")
    if not value.strip():
        raise BadRowError(where, f"column {column!r} is empty")
    return value
