"""An eval report: one checkpoint's metrics next to its base model's and its parent's.

Evaluators return per-item scores (``nll``, ``accuracy``, ``pass@4`` ... per held-out item); here each
becomes a mean with its n and standard error, and the checkpoint's difference from its base and its parent
is paired on the same items (``posttrain.eval.stats``). Which direction is better is decided here, once, by
name (:func:`higher_is_better`); a difference is called better or worse only beyond 2 paired s.e.
"""

from __future__ import annotations

import math
from typing import Any

import pyarrow as pa

from posttrain.eval.items import ItemScores
from posttrain.eval.stats import SIGNIFICANCE_SE, Estimate, PairedDifference, mean_estimate, paired_difference

LOWER_IS_BETTER = frozenset({"nll", "bpb", "teacher_kl", "dpo_loss"})
HIGHER_IS_BETTER = frozenset(
    {"accuracy", "pair_accuracy", "win_rate", "verdict_win_rate", "reward", "agreement", "format_rate", "well_formed",
     "margin", "comparison_accuracy", "orders_agree"}
)


def higher_is_better(metric: str) -> bool | None:
    """True/False for a scored metric, None for an informational one (counts, seconds, standard errors).

    A suite prefix does not change the direction: ``humaneval/pass@1`` is scored like ``pass@1``."""
    metric = metric.rsplit("/", 1)[-1]
    if metric in LOWER_IS_BETTER:
        return False
    if metric in HIGHER_IS_BETTER or metric.startswith("pass@"):
        return True
    return None


def _estimate(items: dict[str, float] | None) -> Estimate | None:
    return mean_estimate(list(items.values())) if items else None


def _paired(checkpoint: dict[str, float], reference: dict[str, float] | None) -> PairedDifference | None:
    if not reference or not set(checkpoint) & set(reference):
        return None
    return paired_difference(checkpoint, reference)


def _verdict(metric: str, difference: PairedDifference | None) -> str:
    """better / worse when the paired difference exceeds 2 s.e. (an aggregate-only metric, n = 1: by its sign),
    ``within noise`` when it does not; empty for informational metrics."""
    direction = higher_is_better(metric)
    if direction is None or difference is None:
        return ""
    if difference.n > 1 and not difference.significant:
        return "within noise"
    if difference.delta == 0:
        return "equal"
    return "better" if (difference.delta > 0) == direction else "worse"


def comparison_rows(checkpoint: ItemScores, base: ItemScores, parent: ItemScores | None = None) -> list[dict[str, Any]]:
    """One row per metric: n, each model's mean ± s.e., and checkpoint − base / − parent paired on the same items.

    Arguments are per-item scores (``posttrain.eval.items``); parent columns are None without a parent."""
    rows = []
    for metric in sorted(checkpoint, key=lambda name: (higher_is_better(name) is None, name)):
        items = checkpoint[metric]
        if not items:
            continue
        own, base_items, parent_items = _estimate(items), base.get(metric), (parent or {}).get(metric)
        base_est, parent_est = _estimate(base_items), _estimate(parent_items)
        vs_base, vs_parent = _paired(items, base_items), _paired(items, parent_items)
        rows.append(
            {
                "metric": metric,
                "n": own.n,
                "checkpoint": own.value,
                "checkpoint_stderr": own.stderr,
                "base": base_est.value if base_est else None,
                "base_stderr": base_est.stderr if base_est else None,
                "parent": parent_est.value if parent_est else None,
                "parent_stderr": parent_est.stderr if parent_est else None,
                "delta_base": vs_base.delta if vs_base else None,
                "delta_base_stderr": vs_base.stderr if vs_base else None,
                "significant_base": vs_base.significant if vs_base else None,
                "delta_parent": vs_parent.delta if vs_parent else None,
                "delta_parent_stderr": vs_parent.stderr if vs_parent else None,
                "significant_parent": vs_parent.significant if vs_parent else None,
                "vs_base": _verdict(metric, vs_base),
                "vs_parent": _verdict(metric, vs_parent),
            }
        )
    return rows


REPORT_SCHEMA = pa.schema(
    [
        ("metric", pa.string()),
        ("n", pa.int64()),
        *[(f"{role}{suffix}", pa.float64()) for role in ("checkpoint", "base", "parent") for suffix in ("", "_stderr")],
        *[
            field
            for against in ("base", "parent")
            for field in (
                (f"delta_{against}", pa.float64()),
                (f"delta_{against}_stderr", pa.float64()),
                (f"significant_{against}", pa.bool_()),
            )
        ],
        ("vs_base", pa.string()),
        ("vs_parent", pa.string()),
    ]
)


def report_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=REPORT_SCHEMA)


def worse(rows: list[dict[str, Any]], against: str = "base") -> list[str]:
    """Metrics on which the checkpoint is worse than ``against`` by more than 2 paired s.e."""
    return [row["metric"] for row in rows if row[f"vs_{against}"] == "worse"]


def _decimals(stderr: float | None) -> int:
    """Digits after the point that the standard error justifies (two significant digits of it; 3 without one)."""
    if stderr is None or not math.isfinite(stderr) or stderr <= 0:
        return 3
    return max(1, min(4, 1 - math.floor(math.log10(stderr))))


def _cell(value: float | None, stderr: float | None) -> str:
    if value is None or math.isnan(value):
        return "–"
    return f"{value:.{_decimals(stderr)}f}"


def _delta_cell(row: dict[str, Any], against: str) -> str:
    delta, stderr = row[f"delta_{against}"], row[f"delta_{against}_stderr"]
    if delta is None:
        return "–"
    digits = _decimals(stderr)
    spread = f" ± {stderr:.{digits}f}" if stderr is not None and math.isfinite(stderr) else ""
    mark = {"better": " ▲", "worse": " ▼"}.get(row[f"vs_{against}"], "")
    return f"{delta:+.{digits}f}{spread}{mark}"


def markdown(rows: list[dict[str, Any]], title: str, has_parent: bool) -> str:
    """One table: metric, n, base, (parent,) checkpoint, and Δ (vs the parent when there is one, else vs the base)
    ± its paired standard error; ▲ / ▼ mark a difference beyond 2 s.e. in the better / worse direction."""
    against = "parent" if has_parent else "base"
    header = "| metric | n | base | " + ("parent | " if has_parent else "") + f"checkpoint | Δ vs {against} (± s.e.) |"
    lines = [title, "", header, "|---|---:|---:|" + ("---:|" if has_parent else "") + "---:|---:|"]
    for row in rows:
        digits_from = row["checkpoint_stderr"]
        cells = [row["metric"], str(row["n"]), _cell(row["base"], digits_from)]
        if has_parent:
            cells.append(_cell(row["parent"], digits_from))
        cells += [_cell(row["checkpoint"], digits_from), _delta_cell(row, against)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Means over n held-out items; Δ is paired on the same items. ▲ better / ▼ worse by more than "
                  f"{SIGNIFICANCE_SE:g} standard errors; unmarked differences are within noise."]
    return "\n".join(lines)
