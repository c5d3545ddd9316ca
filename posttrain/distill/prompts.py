"""Distillation prompts from any prompt table: RL problems, chat conversations or preference comparisons.

Distillation needs only what the student is asked: the teacher's logprobs, not a gold answer, are the
signal. :func:`prompts_table` gives every such table one shape, the ``rl_problems`` schema, so the
student samples it through the problems env (``posttrain.rl.envs``) and its held-out rows feed the eval:

- an ``rl_problems`` table as it is (its answers also give task accuracy);
- a chat table (``messages``): the last user turn before the last assistant reply (the env asks one
  question, so earlier turns and system messages are left out); no gold answer;
- a comparison table (``prompt`` messages): the prompt's last user turn; no gold answer.

Rows without a gold answer have an empty ``scorer`` and ``answer``; their task is the table's dataset
name (``source``), which routes them to a teacher. Row ids and splits are the table's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from posttrain.datasets.schemas import RL_PROBLEMS, table_from_rows

PROMPT_KINDS = ("rl_problems", "chat", "comparison")


def prompt_kind(table: pa.Table) -> str:
    """Which kind of prompt table this is, from its columns; says which columns a prompt table needs."""
    columns = set(table.column_names)
    if {"question", "answer"} <= columns:
        return "rl_problems"
    if "messages" in columns:
        return "chat"
    if {"prompt", "chosen"} <= columns:
        return "comparison"
    raise ValueError(
        f"a distillation prompt table needs question/answer (rl_problems), messages (chat) or prompt/chosen "
        f"(comparisons) columns; got {sorted(columns)}"
    )


def _last_user(messages: Sequence[Mapping[str, Any]]) -> str | None:
    answer = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    users = [m["content"] for m in messages[:answer] if m["role"] == "user"]
    return users[-1] if users else None


def prompts_table(table: pa.Table) -> pa.Table:
    """``table``'s prompts in the ``rl_problems`` schema (see the module docstring); rows with no user turn are left out."""
    kind = prompt_kind(table)
    if kind == "rl_problems":
        return table
    column = "messages" if kind == "chat" else "prompt"
    rows = []
    for row in table.select(["row_id", "source", "split", column]).to_pylist():
        question = _last_user(row[column])
        if question:
            rows.append({"row_id": row["row_id"], "source": row["source"], "split": row["split"], "task": row["source"],
                         "question": question, "answer": "", "scorer": "", "scorer_metadata": "{}"})
    if not rows:
        raise ValueError(f"the {kind} table has no row with a user turn to use as a prompt")
    return table_from_rows(rows, RL_PROBLEMS)


def has_gold_answers(table: pa.Table) -> bool:
    return prompt_kind(table) == "rl_problems"
