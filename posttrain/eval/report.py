"""An eval report: one checkpoint's metrics next to its base model's and its parent's.

Evaluators return flat metrics (``nll``, ``accuracy``, ``pass@4`` ...). Which direction is better is
decided here, once, by name (:func:`higher_is_better`); counts and other informational numbers have no
direction and are never called better or worse.
"""

from __future__ import annotations

import math
from typing import Any

import pyarrow as pa

LOWER_IS_BETTER = frozenset({"nll", "bpb", "teacher_kl", "dpo_loss"})
HIGHER_IS_BETTER = frozenset({"accuracy", "pair_accuracy", "win_rate", "reward", "agreement", "format_rate"})


def higher_is_better(metric: str) -> bool | None:
    """True/False for a scored metric, None for an informational one (counts, seconds, standard errors).

    A suite prefix does not change the direction: ``humaneval/pass@1`` is scored like ``pass@1``."""
    metric = metric.rsplit("/", 1)[-1]
    if metric in LOWER_IS_BETTER:
        return False
    if metric in HIGHER_IS_BETTER or metric.startswith("pass@"):
        return True
    return None


def _delta(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or math.isnan(value) or math.isnan(reference):
        return None
    return value - reference


def _verdict(metric: str, delta: float | None) -> str:
    direction = higher_is_better(metric)
    if direction is None or delta is None:
        return ""
    if delta == 0:
        return "equal"
    return "better" if (delta > 0) == direction else "worse"


def comparison_rows(
    checkpoint: dict[str, float], base: dict[str, float], parent: dict[str, float] | None = None
) -> list[dict[str, Any]]:
    """One row per metric: checkpoint, base, parent values, deltas and verdicts (parent columns None without one)."""
    rows = []
    for metric in sorted(checkpoint, key=lambda name: (higher_is_better(name) is None, name)):
        value = checkpoint[metric]
        parent_value = parent.get(metric) if parent else None
        delta_base = _delta(value, base.get(metric))
        delta_parent = _delta(value, parent_value)
        rows.append(
            {
                "metric": metric,
                "checkpoint": float(value),
                "base": base.get(metric),
                "parent": parent_value,
                "delta_base": delta_base,
                "delta_parent": delta_parent,
                "vs_base": _verdict(metric, delta_base),
                "vs_parent": _verdict(metric, delta_parent),
            }
        )
    return rows


def report_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(
        rows,
        schema=pa.schema(
            [
                ("metric", pa.string()),
                ("checkpoint", pa.float64()),
                ("base", pa.float64()),
                ("parent", pa.float64()),
                ("delta_base", pa.float64()),
                ("delta_parent", pa.float64()),
                ("vs_base", pa.string()),
                ("vs_parent", pa.string()),
            ]
        ),
    )


def worse(rows: list[dict[str, Any]], against: str = "base") -> list[str]:
    return [row["metric"] for row in rows if row[f"vs_{against}"] == "worse"]


def _cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"


def _signed(value: float | None) -> str:
    return "" if value is None else f"{value:+.4f}"


def markdown(rows: list[dict[str, Any]], title: str, has_parent: bool) -> str:
    header = "| metric | base | " + ("parent | " if has_parent else "") + "checkpoint | Δ base | " + ("Δ parent |" if has_parent else "")
    lines = [title, "", header, "|---|" + "---:|" * (5 if has_parent else 3)]
    for row in rows:
        cells = [row["metric"], _cell(row["base"])]
        if has_parent:
            cells.append(_cell(row["parent"]))
        cells += [_cell(row["checkpoint"]), f"{_signed(row['delta_base'])} {row['vs_base']}".strip()]
        if has_parent:
            cells.append(f"{_signed(row['delta_parent'])} {row['vs_parent']}".strip())
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
