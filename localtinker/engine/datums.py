"""Validation of forward/backward inputs, done completely *before* any model state is touched.

Every error names the datum index, the field and the fix, because the message is what a client sees
in its failed future.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from localtinker.engine.api import DatumArrays, EngineUserError
from localtinker.engine.losses import FLOAT_INPUTS


@dataclass
class PreparedDatum:
    tokens: torch.Tensor  # int64 [T]
    targets: torch.Tensor  # int64 [T]
    loss_inputs: dict[str, torch.Tensor]  # float32 [T] each, only the keys the loss uses


def prepare_datums(
    data: list[DatumArrays], loss_fn: str, vocab_size: int, max_length: int
) -> list[PreparedDatum]:
    if not data:
        raise EngineUserError("forward_backward got no data: pass at least one Datum.")
    return [_prepare_one(index, datum, loss_fn, vocab_size, max_length) for index, datum in enumerate(data)]


def _prepare_one(index: int, datum: DatumArrays, loss_fn: str, vocab_size: int, max_length: int) -> PreparedDatum:
    where = f"datum {index}"
    tokens = _token_array(datum.tokens, f"{where} model_input", vocab_size)
    length = tokens.shape[0]
    if length == 0:
        raise EngineUserError(f"{where}: model_input is empty; every Datum needs at least one token.")
    if length > max_length:
        raise EngineUserError(
            f"{where}: model_input has {length} tokens, more than the model's context of {max_length}; "
            "truncate or split the sequence."
        )
    inputs = datum.loss_fn_inputs
    if "target_tokens" not in inputs:
        raise EngineUserError(
            f"{where}: loss_fn_inputs lacks 'target_tokens' (the next token at each position, shifted by one)."
        )
    targets = _token_array(inputs["target_tokens"], f"{where} loss_fn_inputs['target_tokens']", vocab_size)
    _check_length(targets, length, f"{where} loss_fn_inputs['target_tokens']")
    loss_inputs: dict[str, torch.Tensor] = {}
    for key in FLOAT_INPUTS[loss_fn]:
        field_name = f"{where} loss_fn_inputs[{key!r}]"
        if key not in inputs:
            if key == "weights":
                loss_inputs[key] = torch.ones(length, dtype=torch.float32)
                continue
            raise EngineUserError(f"{field_name} is missing; loss {loss_fn!r} needs it for every token.")
        values = np.asarray(inputs[key])
        if values.ndim != 1 or not np.issubdtype(values.dtype, np.number):
            raise EngineUserError(f"{field_name} must be a 1-D numeric array, got shape {values.shape} {values.dtype}.")
        _check_length(values, length, field_name)
        if not np.all(np.isfinite(values)):
            raise EngineUserError(f"{field_name} contains NaN or infinity; send finite numbers.")
        loss_inputs[key] = torch.as_tensor(values, dtype=torch.float32)
    if "sequence_ratio_mask" in loss_inputs and not bool((loss_inputs["sequence_ratio_mask"] != 0).any()):
        raise EngineUserError(
            f"{where} loss_fn_inputs['sequence_ratio_mask'] marks no token; GSPO's sequence ratio is a mean "
            "over the marked (sampled) tokens: set it to 1 on at least one of them."
        )
    return PreparedDatum(tokens=torch.as_tensor(tokens), targets=torch.as_tensor(targets), loss_inputs=loss_inputs)


def _token_array(values: object, field_name: str, vocab_size: int) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise EngineUserError(f"{field_name} must be a 1-D list of token ids, got shape {array.shape}.")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        if not np.issubdtype(array.dtype, np.floating) or not np.all(np.mod(array, 1) == 0):
            raise EngineUserError(f"{field_name} must hold integer token ids, got dtype {array.dtype}.")
    array = array.astype(np.int64)
    bad = np.flatnonzero((array < 0) | (array >= vocab_size))
    if bad.size:
        position = int(bad[0])
        raise EngineUserError(
            f"{field_name}[{position}] = {int(array[position])} is outside the vocabulary [0, {vocab_size}); "
            "tokenize with this model's tokenizer (get_tokenizer())."
        )
    return array


def _check_length(values: np.ndarray, expected: int, field_name: str) -> None:
    if values.shape[0] != expected:
        raise EngineUserError(
            f"{field_name} has {values.shape[0]} entries but model_input has {expected} tokens; "
            "give one value per input position."
        )
