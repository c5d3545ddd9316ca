"""Deterministic held-out split: the rows whose row_id hashes lowest are held out.

Hashing ids (rather than taking the last N rows or a seeded shuffle of positions) keeps a row on the
same side when the source is reordered or `limit` grows, so evaluation rows never leak into training
across re-materializations.
"""

from __future__ import annotations

import hashlib
import math

from posttrain.datasets.schemas import HELDOUT_SPLIT, TRAIN_SPLIT


def _rank_key(row_id: str) -> str:
    return hashlib.sha256(row_id.encode("utf-8")).hexdigest()


def heldout_count(num_rows: int, fraction: float) -> int:
    """ceil(fraction * n), but at least one row stays in training."""
    if fraction <= 0 or num_rows < 2:
        return 0
    return min(num_rows - 1, math.ceil(fraction * num_rows))


def assign_splits(row_ids: list[str], fraction: float) -> list[str]:
    """The split ("train"/"heldout") of each row id, in input order."""
    count = heldout_count(len(row_ids), fraction)
    ranked = sorted(range(len(row_ids)), key=lambda i: _rank_key(row_ids[i]))
    heldout = set(ranked[:count])
    return [HELDOUT_SPLIT if i in heldout else TRAIN_SPLIT for i in range(len(row_ids))]
