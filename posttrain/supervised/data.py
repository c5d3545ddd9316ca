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
from typing import Literal, Protocol, Sequence, get_args

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import tinker

from posttrain.datasets.schemas import TRAIN_SPLIT

LossReduction = Literal["sum", "example_mean", "token_mean"]
LOSS_REDUCTIONS: tuple[str, ...] = get_args(LossReduction)


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


def datum_from_tokens(model_input: Sequence[int], target_tokens: Sequence[int], weights: Sequence[float]) -> tinker.Datum:
    """A cross-entropy ``Datum`` from pre-shifted tokens (``model_input[i]`` predicts ``target_tokens[i]``)."""
    inputs = np.asarray(model_input, dtype=np.int64)
    targets = np.asarray(target_tokens, dtype=np.int64)
    weight_array = np.asarray(weights, dtype=np.float32)
    if not len(inputs) == len(targets) == len(weight_array):
        raise ValueError(
            f"model_input, target_tokens and weights must have equal lengths, got "
            f"{len(inputs)}, {len(targets)}, {len(weight_array)}"
        )
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(inputs.tolist()),
        loss_fn_inputs={"target_tokens": targets, "weights": weight_array},
    )


def datum_weights(datum: tinker.Datum) -> np.ndarray:
    return np.asarray(datum.loss_fn_inputs["weights"].to_numpy(), dtype=np.float32).reshape(-1)


def datum_targets(datum: tinker.Datum) -> np.ndarray:
    return np.asarray(datum.loss_fn_inputs["target_tokens"].to_numpy(), dtype=np.int64).reshape(-1)


def apply_loss_reduction(batch: list[tinker.Datum], reduction: str) -> list[tinker.Datum]:
    """Rescale weights so the server's *summed* loss has the intended normalisation.

    ``sum``: weights as given. ``example_mean``: each example's weights sum to 1 (cookbook SFT default:
    every conversation counts equally). ``token_mean``: every trained token of the batch weighs
    ``1 / trained tokens in the batch`` (loss and gradient scale independent of batch size).
    """
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"unknown loss_reduction {reduction!r}: use one of {', '.join(LOSS_REDUCTIONS)}")
    if reduction == "sum":
        return batch
    weights = [datum_weights(datum) for datum in batch]
    if reduction == "example_mean":
        scales = [1.0 / total if (total := float(w.sum())) > 0 else 0.0 for w in weights]
    else:
        batch_total = float(sum(w.sum() for w in weights))
        scales = [1.0 / batch_total if batch_total > 0 else 0.0] * len(batch)
    return [
        tinker.Datum(
            model_input=datum.model_input,
            loss_fn_inputs={**datum.loss_fn_inputs, "weights": (w * scale).astype(np.float32)},
        )
        for datum, w, scale in zip(batch, weights, scales)
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

    @classmethod
    def from_parquet(cls, path: str, split: str | None = None) -> RenderedTokens:
        import pyarrow.parquet as pq

        return cls(pq.read_table(path), split)

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
