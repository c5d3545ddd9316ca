"""Fast rendering of whole datasets of conversations into token columns.

Public API (stable; the data layer codes against it)::

    from posttrain.renderers import get_renderer, TrainOnWhat
    from posttrain.renderers.batch import render_supervised_batch, RenderedBatch

    renderer = get_renderer("chatml", tokenizer)          # tokenizer: HF fast tokenizer
    batch: RenderedBatch = render_supervised_batch(
        renderer,
        conversations,                                    # Sequence[Sequence[Message]]
        train_on_what=TrainOnWhat.LAST_ASSISTANT_MESSAGE,  # or ALL_ASSISTANT_MESSAGES, ...
        max_length=None,                                  # int: truncate from the right
        errors="raise",                                   # or "skip": bad rows -> batch.skipped
    )
    batch.columns() -> dict[str, list]   # arrow-friendly, one entry per rendered conversation:
        "row_index"           int          index of the conversation in `conversations`
        "tokens"              list[int]    full rendered sequence (after truncation, unshifted)
        "weights"             list[float]  per-token loss weight, same length as "tokens" (raw 0/1)
        "num_tokens"          int          len(tokens)
        "num_trained_tokens"  int          tokens with weight > 0
        "original_num_tokens" int          length before max_length truncation
        "truncated"           bool         original_num_tokens > max_length
    batch.to_arrow() -> pyarrow.Table     # the same columns (tokens int32 lists, weights float32 lists)
    batch.skipped -> list[tuple[int, str]] # (row index, reason) of conversations left out (errors="skip")

Shifting into a training ``tinker.Datum`` (input = tokens[:-1], target = tokens[1:], weights[1:]),
with SFT "mean" normalisation, is ``posttrain.renderers.datum.make_supervised_datum(tokens, weights,
max_length=None, reduction="mean")``.

The rows are token-for-token identical to ``renderer.build_supervised_example`` (tested); the speed
comes from encoding the message contents of all conversations in one batched tokenizer call and
encoding each template piece (headers, end-of-turn markers) once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Literal

import numpy as np
import pyarrow as pa

from posttrain.renderers.base import Renderer
from posttrain.renderers.types import Message, RendererError, TrainOnWhat


@dataclass
class RenderedBatch:
    """Rendered conversations as columns; ``row_index`` is each row's position in the input."""

    row_index: list[int] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    weights: list[np.ndarray] = field(default_factory=list)
    original_num_tokens: list[int] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (row_index, error) with errors="skip"

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def truncated(self) -> list[bool]:
        return [len(row) < original for row, original in zip(self.tokens, self.original_num_tokens, strict=True)]

    def columns(self) -> dict[str, list]:
        return {
            "row_index": self.row_index,
            "tokens": self.tokens,
            "weights": [row.tolist() for row in self.weights],
            "num_tokens": [len(row) for row in self.tokens],
            "num_trained_tokens": [int(np.count_nonzero(row)) for row in self.weights],
            "original_num_tokens": self.original_num_tokens,
            "truncated": self.truncated,
        }

    def to_arrow(self) -> pa.Table:
        lengths = np.fromiter((len(row) for row in self.tokens), dtype=np.int64, count=len(self.tokens))
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        flat_tokens = np.fromiter(chain.from_iterable(self.tokens), dtype=np.int32, count=int(lengths.sum()))
        flat_weights = np.concatenate(self.weights) if self.weights else np.zeros(0, np.float32)
        trained = np.fromiter((np.count_nonzero(row) for row in self.weights), dtype=np.int32, count=len(self.weights))
        return pa.table(
            {
                "row_index": pa.array(self.row_index, pa.int64()),
                "tokens": pa.ListArray.from_arrays(offsets, pa.array(flat_tokens, pa.int32())),
                "weights": pa.ListArray.from_arrays(offsets, pa.array(flat_weights.astype(np.float32), pa.float32())),
                "num_tokens": pa.array(lengths.astype(np.int32)),
                "num_trained_tokens": pa.array(trained),
                "original_num_tokens": pa.array(self.original_num_tokens, pa.int32()),
                "truncated": pa.array(self.truncated, pa.bool_()),
            }
        )


def render_supervised_batch(
    renderer: Renderer,
    conversations: Sequence[Sequence[Message]],
    train_on_what: TrainOnWhat = TrainOnWhat.LAST_ASSISTANT_MESSAGE,
    max_length: int | None = None,
    errors: Literal["raise", "skip"] = "raise",
) -> RenderedBatch:
    """Renders many conversations; identical rows to ``renderer.build_supervised_example`` each.

    ``errors="raise"`` stops at the first conversation that cannot be rendered, naming its index;
    ``errors="skip"`` leaves it out and records ``(index, reason)`` in ``batch.skipped``.
    """
    train_on_what = TrainOnWhat(train_on_what)
    batch = RenderedBatch()
    if not renderer.renders_by_pieces:
        for index, conversation in enumerate(conversations):
            try:
                model_input, weights = renderer.build_supervised_example(conversation, train_on_what)
            except RendererError as error:
                _skip_or_raise(batch, index, error, errors)
                continue
            _append(batch, index, model_input.to_ints(), weights, max_length)
        return batch
    planned = []
    for index, conversation in enumerate(conversations):
        try:
            planned.append((index, renderer.supervised_plan(conversation, train_on_what)))
        except RendererError as error:
            _skip_or_raise(batch, index, error, errors)
    literal_tokens = iter(
        renderer.codec.encode_content_batch([piece.text for _, plan in planned for piece in plan.pieces if piece.literal])
    )
    encode_template = renderer.encode_template
    for index, plan in planned:
        plan_tokens = [next(literal_tokens) if piece.literal else encode_template(piece.text) for piece in plan.pieces]
        try:
            tokens, weights = renderer.assemble_supervised(plan, plan_tokens)
        except RendererError as error:
            _skip_or_raise(batch, index, error, errors)
            continue
        _append(batch, index, tokens, weights, max_length)
    return batch


def _skip_or_raise(batch: RenderedBatch, index: int, error: RendererError, errors: str) -> None:
    if errors == "raise":
        raise RendererError(f"conversation {index}: {error}") from error
    batch.skipped.append((index, str(error)))


def _append(batch: RenderedBatch, index: int, tokens: list[int], weights: np.ndarray, max_length: int | None) -> None:
    batch.row_index.append(index)
    batch.original_num_tokens.append(len(tokens))
    if max_length is not None and len(tokens) > max_length:
        tokens, weights = tokens[:max_length], weights[:max_length]
    batch.tokens.append(tokens)
    batch.weights.append(np.asarray(weights, dtype=np.float32))
