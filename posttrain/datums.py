"""Reading and building ``tinker.Datum`` token arrays: shared by training, evaluation and every recipe."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tinker

__all__ = ["datum_from_tokens", "datum_targets", "datum_weights"]


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
