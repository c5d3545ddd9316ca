"""Per-item scores: what an eval report's means, standard errors and paired comparisons are computed from.

A report evaluator returns, for each metric, one score per held-out item keyed by the hash of the item's
normalized prompt (``prompt_key``). The same table version gives the same keys to the checkpoint, its
base model and its parent, so ``posttrain.eval.stats.paired_difference`` pairs them item by item, and
a cached base score still pairs after the rows are read in another order.

Evaluators that report only aggregates (no ``score_items``) still appear in a report, as one item.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Protocol

from posttrain.datasets.splits import normalize_prompt
from posttrain.eval.base import EvalTarget, Evaluator

ItemScores = dict[str, dict[str, float]]
"""metric -> item key -> score."""

AGGREGATE_KEY = "*"  # the one "item" of a metric reported only as an aggregate


class ItemEvaluator(Protocol):
    def score_items(self, target: EvalTarget) -> ItemScores: ...


def prompt_key(prompt: str) -> str:
    """The item key of a prompt: 16 hex digits of sha256 of its normalized text (as the held-out split hashes it)."""
    return hashlib.sha256(normalize_prompt(prompt).encode("utf-8")).hexdigest()[:16]


def unique_keys(prompts: Iterable[str]) -> list[str]:
    """``prompt_key`` of each prompt; a repeated prompt gets ``#2``, ``#3`` ... so no item hides another."""
    seen: dict[str, int] = {}
    keys = []
    for prompt in prompts:
        key = prompt_key(prompt)
        seen[key] = seen.get(key, 0) + 1
        keys.append(key if seen[key] == 1 else f"{key}#{seen[key]}")
    return keys


def mean_metrics(items: ItemScores) -> dict[str, float]:
    """The plain mean of each metric over its items (what an in-loop evaluator logs)."""
    return {metric: sum(values.values()) / len(values) for metric, values in items.items() if values}


def score_items(evaluators: Sequence[Evaluator], target: EvalTarget) -> ItemScores:
    """Every evaluator's per-item scores on ``target``; an aggregate-only evaluator's metrics as one item each."""
    scores: ItemScores = {}
    for evaluator in evaluators:
        scorer = getattr(evaluator, "score_items", None)
        if scorer is not None:
            scores.update(scorer(target))
        else:
            scores.update({metric: {AGGREGATE_KEY: float(value)} for metric, value in evaluator(target).items()})
    return scores
