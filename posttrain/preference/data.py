"""Preference pairs as training data: validation, pair-preserving batches, deterministic order.

Input is a ``preference_pairs`` Arrow table (``posttrain.datasets.schemas.PREFERENCE_PAIRS``, built by
``posttrain.datasets.tokens.render_comparisons_table``). A batch is a list of *pairs*; it becomes
``2 × pairs`` datums with datum ``2i`` the chosen and ``2i + 1`` the rejected side of pair ``i``, so a
pair is never split across batches and the DPO loss (``posttrain.preference.dpo``) can find both sides.

Order: the pairs of epoch ``e`` are a permutation seeded by ``(seed, e)`` alone, and step ``s`` reads
batch ``s mod batches_per_epoch`` of epoch ``s // batches_per_epoch``, so resuming at step ``s``
trains exactly what an uninterrupted run would. The last, smaller batch of an epoch is kept by
default (the loss is a mean over pairs, so its scale does not depend on the batch size); with
``drop_last`` it is dropped, and every step sees ``batch_size`` pairs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import tinker

from posttrain.datasets.rows import BadRowError
from posttrain.datasets.schemas import TRAIN_SPLIT
from posttrain.supervised.data import datum_from_tokens, epoch_order

SIDES = ("chosen", "rejected")
PAIR_COLUMNS = ("row_id", "prompt_length") + tuple(
    f"{side}_{column}" for side in SIDES for column in ("model_input", "target_tokens", "weights")
)
MAX_LISTED_PROBLEMS = 5


class BadPairError(BadRowError):
    """A preference pair cannot be trained on; the message names its row id and how to fix it."""


@dataclass(frozen=True)
class Side:
    """One rendered side of a pair, pre-shifted: ``model_input[i]`` predicts ``target_tokens[i]``."""

    model_input: list[int]
    target_tokens: list[int]
    weights: list[float]

    def full_sequence(self) -> list[int]:
        """The unshifted tokens (what ``compute_logprobs`` scores)."""
        return self.model_input + self.target_tokens[-1:]

    def datum(self) -> tinker.Datum:
        return datum_from_tokens(self.model_input, self.target_tokens, self.weights)


@dataclass(frozen=True)
class Pair:
    row_id: str
    prompt_length: int
    chosen: Side
    rejected: Side


def pair_problem(pair: Pair) -> str | None:
    """Why ``pair`` cannot be trained on (with the fix), or None when it is usable."""
    for name, side in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        lengths = {len(side.model_input), len(side.target_tokens), len(side.weights)}
        if len(lengths) != 1:
            return (f"{name} model_input, target_tokens and weights have different lengths {sorted(lengths)}: "
                    "re-render the pair with posttrain.datasets.tokens.render_comparisons_table")
        if side.model_input[1:] != side.target_tokens[:-1]:
            return (f"{name} target_tokens are not model_input shifted by one token: "
                    "re-render the pair with posttrain.datasets.tokens.render_comparisons_table")
        if not any(w > 0 for w in side.weights):
            return (f"the {name} response has no trained tokens (empty, or truncated away by max_length): "
                    "give it a non-empty completion, raise max_length, or drop the row (skip_bad_rows)")
    chosen, rejected = pair.chosen.full_sequence(), pair.rejected.full_sequence()
    if chosen == rejected and pair.chosen.weights == pair.rejected.weights:
        return "chosen and rejected are identical, so the pair carries no preference: fix or drop the row"
    length = pair.prompt_length
    if length <= 0 or chosen[:length] != rejected[:length]:
        return (f"chosen and rejected do not share their first {length} prompt tokens (different prompts?): "
                "both sides must continue the same rendered prompt; render them from one prompt")
    return None


def pairs_from_table(table: pa.Table, split: str | None = TRAIN_SPLIT) -> list[Pair]:
    """The pairs of a ``preference_pairs`` table (only ``split`` rows when the table has a split column)."""
    missing = [name for name in PAIR_COLUMNS if name not in table.column_names]
    if missing:
        raise ValueError(
            f"preference-pair table lacks columns {missing} (has {table.column_names}); build it with "
            "posttrain.datasets.tokens.render_comparisons_table (the preference_pairs schema)"
        )
    if split is not None and "split" in table.column_names:
        table = table.filter(pc.equal(table.column("split"), split))
    columns = table.select(list(PAIR_COLUMNS)).to_pydict()
    pairs = []
    for index, row_id in enumerate(columns["row_id"]):
        sides = {
            side: Side(*(list(columns[f"{side}_{name}"][index]) for name in ("model_input", "target_tokens", "weights")))
            for side in SIDES
        }
        pairs.append(Pair(str(row_id), int(columns["prompt_length"][index]), sides["chosen"], sides["rejected"]))
    return pairs


def validate_pairs(pairs: Sequence[Pair]) -> None:
    """Raise :class:`BadPairError` naming the first bad pair (and how many more there are)."""
    problems = [(pair.row_id, problem) for pair in pairs if (problem := pair_problem(pair)) is not None]
    seen: set[str] = set()
    for pair in pairs:
        if pair.row_id in seen:
            problems.append((pair.row_id, "row_id appears more than once: row ids key the reference logprobs, make them unique"))
        seen.add(pair.row_id)
    if problems:
        row_id, problem = problems[0]
        others = [other for other, _ in problems[1:MAX_LISTED_PROBLEMS]]
        more = f" ({len(problems) - 1} more bad pairs, e.g. {others})" if len(problems) > 1 else ""
        raise BadPairError(f"preference pair {row_id!r}", problem + more)


class PreferencePairs:
    """Validated pairs with random access by pair index."""

    def __init__(self, pairs: Sequence[Pair]):
        if not pairs:
            raise ValueError("no preference pairs to train on: check the table's split column and row count")
        validate_pairs(pairs)
        self.pairs = list(pairs)

    @classmethod
    def from_table(cls, table: pa.Table, split: str | None = TRAIN_SPLIT) -> PreferencePairs:
        return cls(pairs_from_table(table, split))

    def __len__(self) -> int:
        return len(self.pairs)

    def row_ids(self) -> list[str]:
        return [pair.row_id for pair in self.pairs]

    def data_at(self, indices: Sequence[int] | np.ndarray) -> list[tinker.Datum]:
        """``2 × len(indices)`` datums: chosen then rejected of each pair, in order."""
        return [datum for i in indices for datum in (self.pairs[int(i)].chosen.datum(), self.pairs[int(i)].rejected.datum())]

    def digest(self) -> str:
        """A content hash (row ids, tokens, weights) that changes whenever step ``k``'s data would."""
        digest = hashlib.sha256()
        for pair in self.pairs:
            digest.update(repr((pair.row_id, pair.prompt_length, pair.chosen, pair.rejected)).encode())
        return digest.hexdigest()[:16]


@dataclass(frozen=True)
class PairBatching:
    """How pairs become numbered steps: ``batch_size`` pairs per step over ``num_epochs`` epochs."""

    num_pairs: int
    batch_size: int
    num_epochs: int = 1
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False

    def __post_init__(self) -> None:
        if self.batch_size <= 0 or self.num_epochs <= 0:
            raise ValueError(f"batch_size and num_epochs must be positive, got {self.batch_size} and {self.num_epochs}")
        if self.batches_per_epoch() == 0:
            raise ValueError(
                f"{self.num_pairs} pairs make no complete batch of {self.batch_size} with drop_last: "
                "lower batch_size, add pairs or set drop_last=False"
            )

    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.num_pairs, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def num_steps(self) -> int:
        return self.batches_per_epoch() * self.num_epochs

    def epoch_of(self, step: int) -> int:
        return step // self.batches_per_epoch()

    def pair_indices(self, step: int) -> np.ndarray:
        """The pair indices step ``step`` trains on: a pure function of (step, seed, sizes)."""
        if not 0 <= step < self.num_steps():
            raise IndexError(f"step {step} out of range: {self.num_pairs} pairs make {self.num_steps()} steps")
        epoch, batch_index = divmod(step, self.batches_per_epoch())
        start = batch_index * self.batch_size
        return epoch_order(self.num_pairs, epoch, self.seed, self.shuffle)[start : start + self.batch_size]
