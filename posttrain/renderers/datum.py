"""From a rendered example to a training ``tinker.Datum``: truncate, shift, normalise weights.

The model predicts token t+1 from tokens <= t, so the datum's input is ``tokens[:-1]``, its
``target_tokens`` are ``tokens[1:]`` and its ``weights`` are ``weights[1:]``.

Weight reduction (cookbook ``reduction``): ``"mean"`` (the SFT default) rescales an example's weights
to sum to 1, so every example counts the same whatever its length; ``"sum"`` keeps the raw 0/1
weights, so the loss is a token sum (DPO's log-probability sums use this).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import tinker

Reduction = Literal["mean", "sum"]


@dataclass(frozen=True)
class SupervisedDatum:
    datum: tinker.Datum
    original_num_tokens: int  # before truncation
    num_tokens: int  # after truncation (the datum has num_tokens - 1 positions)

    @property
    def truncated(self) -> bool:
        return self.num_tokens < self.original_num_tokens


def normalise_weights(weights: np.ndarray, reduction: Reduction) -> np.ndarray:
    weights = np.asarray(weights, dtype=np.float32)
    if reduction == "sum":
        return weights
    if reduction == "mean":
        total = float(weights.sum())
        return weights / total if total > 0 else weights
    raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")


def make_supervised_datum(
    tokens: Sequence[int] | tinker.ModelInput,
    weights: Sequence[float] | np.ndarray,
    max_length: int | None = None,
    reduction: Reduction = "mean",
) -> SupervisedDatum:
    """Shifted datum from unshifted tokens (or a text ``ModelInput``) and one weight per token.

    ``max_length`` truncates the sequence from the right *before* shifting (so the datum has at most
    ``max_length - 1`` positions); ``truncated`` on the result reports it. Weights are normalised after
    truncation and shifting, over the tokens actually trained.
    """
    token_list = tokens.to_ints() if isinstance(tokens, tinker.ModelInput) else list(tokens)
    weight_array = np.asarray(weights, dtype=np.float32)
    if weight_array.shape != (len(token_list),):
        raise ValueError(
            f"weights must have one entry per token: {len(token_list)} tokens, weights shape {weight_array.shape}"
        )
    if len(token_list) < 2:
        raise ValueError(f"an example needs at least 2 tokens to predict one, got {len(token_list)}")
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length must be at least 2, got {max_length}")
    original = len(token_list)
    if max_length is not None and original > max_length:
        token_list, weight_array = token_list[:max_length], weight_array[:max_length]
    targets = np.asarray(token_list[1:], dtype=np.int64)
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints(token_list[:-1]),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(targets),
            "weights": tinker.TensorData.from_numpy(normalise_weights(weight_array[1:], reduction)),
        },
    )
    return SupervisedDatum(datum=datum, original_num_tokens=original, num_tokens=len(token_list))
