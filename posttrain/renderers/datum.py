"""From a rendered example to a training ``tinker.Datum``: truncate, shift, normalise weights.

The model predicts token t+1 from tokens <= t, so the datum's input is ``tokens[:-1]``, its
``target_tokens`` are ``tokens[1:]`` and its ``weights`` are ``weights[1:]``.

Weight reduction (:func:`reduce_weights`, the project's one implementation; the trainer's
``posttrain.supervised.data.apply_loss_reduction`` applies it to a batch of ``Datum``): the server sums
``weight * loss`` over tokens and datums, so the reduction is chosen by rescaling weights.

- ``"mean"`` (cookbook 0.6.1's SFT default): each example's weights sum to 1, so every example counts
  the same whatever its length (``"example_mean"`` is accepted as another name for it);
- ``"sum"``: the raw 0/1 weights, so the loss is a token sum (DPO's log-probability sums use this);
- ``"token_mean"``: every trained token of the batch weighs ``1 / trained tokens in the batch``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import tinker

LossReduction = Literal["mean", "sum", "token_mean"]
REDUCTION_ALIASES = {"example_mean": "mean"}
LOSS_REDUCTIONS: tuple[str, ...] = (*get_args(LossReduction), *REDUCTION_ALIASES)


@dataclass(frozen=True)
class SupervisedDatum:
    datum: tinker.Datum
    original_num_tokens: int  # before truncation
    num_tokens: int  # after truncation (the datum has num_tokens - 1 positions)

    @property
    def truncated(self) -> bool:
        return self.num_tokens < self.original_num_tokens


def reduce_weights(weights_per_example: Sequence[np.ndarray], reduction: str = "mean") -> list[np.ndarray]:
    """Each example's float32 weights rescaled for `reduction` (see the module docstring); an example
    with no trained token keeps its zeros."""
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"unknown loss reduction {reduction!r}: use one of {', '.join(LOSS_REDUCTIONS)}")
    reduction = REDUCTION_ALIASES.get(reduction, reduction)
    weights = [np.asarray(w, dtype=np.float32) for w in weights_per_example]
    if reduction == "sum":
        return weights
    if reduction == "mean":
        totals = [float(w.sum()) for w in weights]
    else:
        totals = [float(sum(w.sum() for w in weights))] * len(weights)
    return [(w / total).astype(np.float32) if total > 0 else w for w, total in zip(weights, totals, strict=True)]


def make_supervised_datum(
    tokens: Sequence[int] | tinker.ModelInput,
    weights: Sequence[float] | np.ndarray,
    max_length: int | None = None,
    reduction: str = "mean",
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
            "weights": tinker.TensorData.from_numpy(reduce_weights([weight_array[1:]], reduction)[0]),
        },
    )
    return SupervisedDatum(datum=datum, original_num_tokens=original, num_tokens=len(token_list))
