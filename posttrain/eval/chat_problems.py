"""Held-out chat conversations as question / gold-answer problems for task accuracy."""

from __future__ import annotations

import pyarrow as pa

from posttrain.datasets.schemas import HELDOUT_SPLIT
from posttrain.eval.accuracy import TaskProblem


def problems_from_chat(table: pa.Table, limit: int = 0, split: str = HELDOUT_SPLIT) -> list[TaskProblem]:
    """``split`` conversations as problems: the last user turn asks, the last assistant turn is the gold answer."""
    problems = []
    for row in table.to_pylist():
        if row.get("split") != split:
            continue
        messages = row["messages"]
        users = [m["content"] for m in messages if m["role"] == "user"]
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        systems = [m["content"] for m in messages if m["role"] == "system"]
        if users and answers:
            problems.append(
                TaskProblem(question=users[-1], answer=answers[-1], row_id=row["row_id"], system=systems[0] if systems else None)
            )
    return problems[:limit] if limit else problems
