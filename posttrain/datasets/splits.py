"""Held-out membership as a pure function of a row's prompt: hash(normalized prompt) < heldout_fraction.

The split of a row depends only on its own content, never on which other rows were loaded: a row is
held out when the sha256 of its normalized prompt, read as a number in [0, 1), falls below the
fraction. So membership is stable when `limit` grows or shrinks, when the source is reordered and
across re-materializations, and two rows with the same prompt (the same question with two answers,
a duplicated hub row) always land on the same side, so an evaluated prompt is never trained on.

The prompt is what the model is shown before the trained answer: the messages before the last
assistant message of a conversation, the prompt of a preference comparison, the question of an RL
problem, the statement of a code problem. Normalization collapses whitespace and case-folds, so
trivial reformatting does not move a prompt across the split. The held-out share of a table is
therefore `heldout_fraction` in expectation, not exactly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.datasets.schemas import HELDOUT_SPLIT, TRAIN_SPLIT

_HASH_SPACE = float(1 << 64)


def normalize_prompt(text: str) -> str:
    """Whitespace runs collapsed to one space, ends stripped, case-folded."""
    return " ".join(text.split()).casefold()


def messages_text(messages: Sequence[Mapping[str, str]]) -> str:
    """One `role: content` line per message."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def conversation_prompt(messages: Sequence[Mapping[str, str]]) -> str:
    """The messages before the last assistant message (the trained answer)."""
    answer = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    return messages_text(messages[:answer])


def _single_question(messages: Sequence[Mapping[str, str]]) -> str | None:
    """The text of a prompt that is one user message, else None."""
    return messages[0]["content"] if len(messages) == 1 and messages[0]["role"] == "user" else None


def row_prompt(kind: str, row: Mapping[str, Any]) -> str:
    """The prompt of a normalized row of `kind` (chat, comparison, rl, code), before normalization.

    A prompt that is a single user message hashes as its text alone, like an RL problem's question: the same
    question in a chat table, a comparison table and a problems table lands on the same side of the split, so
    SFT or DPO never trains on a problem an RL eval holds out."""
    if kind == "chat":
        prompt = row["messages"][: max((i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"), default=len(row["messages"]))]
        return _single_question(prompt) or conversation_prompt(row["messages"])
    if kind == "comparison":
        return _single_question(row["prompt"]) or messages_text(row["prompt"])
    if kind == "rl":
        return row["question"]
    if kind == "code":
        return row["prompt"]
    raise ValueError(f"row_prompt: unknown dataset kind {kind!r}; expected chat, comparison, rl or code")


def prompt_position(prompt: str) -> float:
    """Where a prompt hashes to in [0, 1): the first 64 bits of sha256(normalized prompt)."""
    digest = hashlib.sha256(normalize_prompt(prompt).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / _HASH_SPACE


def split_of(prompt: str, heldout_fraction: float) -> str:
    """"heldout" when the prompt hashes below `heldout_fraction`, else "train"."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    return HELDOUT_SPLIT if prompt_position(prompt) < heldout_fraction else TRAIN_SPLIT


def assign_splits(prompts: Sequence[str], heldout_fraction: float) -> list[str]:
    """The split of each prompt, in input order (each one independent of the others)."""
    return [split_of(prompt, heldout_fraction) for prompt in prompts]
