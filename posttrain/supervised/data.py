"""Supervised training data as numbered batches: deterministic shuffling and resume index math.

Training data is random access (:class:`SupervisedData`: ``len`` + ``data_at(indices)``), never a
one-shot iterator, because resuming at optimizer step ``s`` must train exactly the batch that step
``s`` would have trained: ``epoch = s // num_batches``, ``batch_index = s % num_batches``, and the order inside an epoch
is a permutation seeded by ``(seed, epoch)`` alone. Incomplete last batches are dropped (cookbook
behaviour) so every step sees ``batch_size`` examples.

Two sources: a list of ``tinker.Datum`` (:class:`DatumList`) or an Arrow table with the data layer's
rendered-token columns ``model_input``, ``target_tokens``, ``weights`` (:class:`RenderedTokens`; see
``posttrain.datasets.schemas.RENDERED_TOKENS``), converted to ``Datum`` lazily per batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import tinker

from posttrain.datasets.schemas import TRAIN_SPLIT
from posttrain.datums import datum_from_tokens, datum_weights
from posttrain.renderers.datum import LOSS_REDUCTIONS as LOSS_REDUCTIONS  # re-exported for the configs
from posttrain.renderers.datum import REDUCTION_ALIASES, reduce_weights
from posttrain.renderers.datum import LossReduction as LossReduction


class SupervisedData(Protocol):
    """Random-access training examples; the trainer decides the order (seeded shuffle) and batching."""

    def __len__(self) -> int: ...

    def data_at(self, indices: Sequence[int] | np.ndarray) -> list[tinker.Datum]: ...


@dataclass(frozen=True)
class BatchPosition:
    """Where optimizer step ``step`` (0-based, global over epochs) reads its batch."""

    step: int
    epoch: int
    batch_index: int


def batch_position(step: int, num_batches: int) -> BatchPosition:
    if num_batches <= 0:
        raise ValueError("the dataset has no complete batch: lower batch_size or add examples")
    return BatchPosition(step=step, epoch=step // num_batches, batch_index=step % num_batches)


def planned_steps(num_batches: int, num_epochs: int, max_steps: int | None) -> int:
    """Total optimizer steps of a run: every batch of every epoch, capped by ``max_steps``."""
    total = num_batches * num_epochs
    return total if max_steps is None else min(total, max_steps)


def epoch_order(num_examples: int, epoch: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """The example order of ``epoch``: a permutation depending only on ``(seed, epoch)``."""
    if not shuffle:
        return np.arange(num_examples)
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def batch_indices(num_examples: int, batch_size: int, epoch: int, batch_index: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """Example indices of batch ``batch_index`` of ``epoch``."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    count = num_examples // batch_size
    if not 0 <= batch_index < count:
        raise IndexError(f"batch_index {batch_index} out of range: {num_examples} examples make {count} batches of {batch_size}")
    return epoch_order(num_examples, epoch, seed, shuffle)[batch_index * batch_size : (batch_index + 1) * batch_size]


def apply_loss_reduction(batch: list[tinker.Datum], reduction: str = "mean") -> list[tinker.Datum]:
    """The batch with its weights rescaled by ``posttrain.renderers.datum.reduce_weights`` so the server's
    *summed* loss has the intended normalisation: ``mean`` (cookbook default, alias ``example_mean``):
    each example's weights sum to 1; ``sum``: weights as given; ``token_mean``: every trained token of
    the batch weighs ``1 / trained tokens in the batch``."""
    reduced = reduce_weights([datum_weights(datum) for datum in batch], reduction)
    if REDUCTION_ALIASES.get(reduction, reduction) == "sum":
        return batch
    return [
        tinker.Datum(model_input=datum.model_input, loss_fn_inputs={**datum.loss_fn_inputs, "weights": weights})
        for datum, weights in zip(batch, reduced, strict=True)
    ]


class DatumList:
    """An in-memory list of ``Datum``."""

    def __init__(self, data: Sequence[tinker.Datum]):
        self.data = list(data)

    def __len__(self) -> int:
        return len(self.data)

    def data_at(self, indices: Sequence[int] | np.ndarray) -> list[tinker.Datum]:
        return [self.data[int(i)] for i in indices]


class RenderedTokens:
    """An Arrow table of rendered tokens; rows become ``Datum`` only when their batch is read.

    ``split``: keep only rows whose ``split`` column equals it (e.g. "train"); None keeps all rows.
    """

    COLUMNS = ("model_input", "target_tokens", "weights")

    def __init__(self, table: pa.Table, split: str | None = None):
        missing = [name for name in self.COLUMNS if name not in table.column_names]
        if missing:
            raise ValueError(
                f"rendered-token table lacks columns {missing} (has {table.column_names}); "
                "build it with the data layer's rendered_tokens schema"
            )
        if split is not None and "split" in table.column_names:
            table = table.filter(pc.equal(table["split"], split))
        self.table = table.select(list(self.COLUMNS)).combine_chunks()

    def __len__(self) -> int:
        return self.table.num_rows

    def data_at(self, indices: Sequence[int] | np.ndarray) -> list[tinker.Datum]:
        rows = self.table.take(pa.array(np.asarray(indices, dtype=np.int64))).to_pydict()
        return [
            datum_from_tokens(inputs, targets, weights)
            for inputs, targets, weights in zip(rows["model_input"], rows["target_tokens"], rows["weights"])
        ]

    def all_data(self) -> list[tinker.Datum]:
        return self.data_at(np.arange(self.table.num_rows))


def as_supervised_data(data: SupervisedData | Sequence[tinker.Datum] | pa.Table) -> SupervisedData:
    """Accept a ``SupervisedData``, a list of ``Datum`` or a rendered-token Arrow table.

    A table with a ``split`` column contributes only its training rows, so held-out rows never leak
    into training by default; wrap it in ``RenderedTokens(table, split=None)`` to train on every row.
    """
    if isinstance(data, pa.Table):
        return RenderedTokens(data, split=TRAIN_SPLIT if "split" in data.column_names else None)
    if hasattr(data, "data_at"):
        return data  # type: ignore[return-value]
    return DatumList(data)  # type: ignore[arg-type]


def get_batch(data: SupervisedData, batch_size: int, epoch: int, batch_index: int, seed: int, shuffle: bool = True) -> list[tinker.Datum]:
    """Batch ``batch_index`` of ``epoch``: a pure function of its arguments, which is what makes resume exact."""
    return data.data_at(batch_indices(len(data), batch_size, epoch, batch_index, seed, shuffle))
