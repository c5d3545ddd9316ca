"""Hidden states → token logprobs on the portable path: the unembedding and the log-softmax a chunk of rows
at a time, recomputed in the backward, so no [tokens × vocab] float32 tensor outlives its chunk.

With autograd each chunk runs under activation checkpointing: the forward keeps only the chunk's hidden
states, and the backward recomputes its logits. The log-softmax of a target and its gradient are one
function each of the unembedding's own output (:class:`_TargetLogprobs`), in float32 inside: a bf16 model's
logits are read in bf16 and their gradient is written in bf16, so no [tokens × vocab] float32 tensor exists
where these functions are compiled (CUDA with Triton; ``LOCALTINKER_TRAIN_COMPILE=0`` keeps them eager).
Taken op by op, the float32 copy, its exponential, the gather's scatter and the casts were ~10 passes over
float32 logits, ~5 ms of a 58 ms 1B SFT step on an H200 (docs/localtinker-gpu.md). The same function
serves the trainer and the portable sampler (:func:`output_logits`), so their logprobs agree.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from localtinker.engine.decode_layer import TRAIN_COMPILE_ENV, compile_by_default, compiled_once

LOGIT_CHUNK_TOKENS = 2048


def output_logits(hidden: torch.Tensor, lm_head: torch.nn.Module, softcap: float | None,
                  temperature: float = 1.0) -> torch.Tensor:
    """float32 logits of the model's distribution: the unembedding, then the final-logit soft cap
    (Gemma 2/3: ``cap·tanh(logits / cap)``), then the temperature."""
    return _scaled(lm_head(hidden), softcap, temperature)


def _scaled(logits: torch.Tensor, softcap: float | None, temperature: float) -> torch.Tensor:
    """The unembedding's output as :func:`output_logits` returns it: float32, soft-capped, over the temperature."""
    z = logits.float()
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    return z / temperature if temperature != 1.0 else z


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, softcap: float | None,
                    temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 logprob of each row's target, the row's log-normaliser) under the scaled logits."""
    z = _scaled(logits, softcap, temperature)
    log_total = z.logsumexp(dim=-1)
    return z.gather(-1, targets[:, None]).squeeze(-1) - log_total, log_total


def logits_gradient(logits: torch.Tensor, targets: torch.Tensor, log_total: torch.Tensor, grad: torch.Tensor,
                    softcap: float | None, temperature: float) -> torch.Tensor:
    """The gradient of ``Σ grad · logprob(target)`` with respect to the unembedding's output ``logits``, in
    their dtype: ``grad · (onehot(target) − softmax)``, through the temperature and the soft cap. The one-hot is a
    comparison with the column index, so a compiler fuses the whole of it into one pass."""
    z = _scaled(logits, softcap, temperature)
    columns = torch.arange(logits.shape[-1], device=logits.device)
    g = grad[:, None] * ((columns[None] == targets[:, None]).float() - torch.exp(z - log_total[:, None]))
    if temperature != 1.0:
        g = g / temperature
    if softcap:
        g = g * (1 - torch.tanh(logits.float() / softcap).square())
    return g.to(logits.dtype)


_EAGER = (target_logprobs, logits_gradient)
_compile_on: dict[torch.device, bool] = {}  # per device, decided at its first call


def _functions(device: torch.device) -> tuple[Callable, ...]:
    """(target_logprobs, logits_gradient), compiled where the training pieces are (dynamic in the row count,
    once per process)."""
    if device not in _compile_on:
        _compile_on[device] = compile_by_default(device, TRAIN_COMPILE_ENV)[0]
    return tuple(compiled_once(fn, dynamic=True) for fn in _EAGER) if _compile_on[device] else _EAGER


def _call(index: int, *args):
    """Function ``index`` of :func:`_functions` on ``args``; a compiler failure says why once, then the
    function runs op by op on that device."""
    device = args[0].device
    try:
        return _functions(device)[index](*args)
    except Exception as error:  # noqa: BLE001 - a compiler failure
        if not _compile_on[device] or isinstance(error, (ValueError, torch.OutOfMemoryError)):
            raise
        _compile_on[device] = False
        warnings.warn(f"chunked logprobs: compiling the log-softmax failed ({type(error).__name__}: {error}); "
                      "running it op by op", RuntimeWarning, stacklevel=2)
        return _EAGER[index](*args)


class _TargetLogprobs(torch.autograd.Function):
    """Target logprobs of the unembedding's output, whose backward writes the logits' gradient in one pass."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, softcap: float | None,
                temperature: float) -> torch.Tensor:
        logprobs, log_total = _call(0, logits, targets, softcap, temperature)
        ctx.save_for_backward(logits, targets, log_total)
        ctx.softcap, ctx.temperature = softcap, temperature
        return logprobs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets, log_total = ctx.saved_tensors
        return _call(1, logits, targets, log_total, grad.contiguous(), ctx.softcap, ctx.temperature), None, None, None


def _chunk_logprobs(hidden: torch.Tensor, targets: torch.Tensor, lm_head: torch.nn.Module, softcap: float | None,
                    temperature: float) -> torch.Tensor:
    logits = lm_head(hidden)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _TargetLogprobs.apply(logits, targets, softcap, temperature)
    return _call(0, logits, targets, softcap, temperature)[0]


def chunked_token_logprobs(hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor,
                           softcap: float | None = None, temperature: float = 1.0,
                           chunk: int = LOGIT_CHUNK_TOKENS) -> torch.Tensor:
    """float32 logprob of ``targets[i]`` under the model's (temperature-scaled) distribution at ``hidden[i]``."""
    pieces = []
    for start in range(0, hidden.shape[0], chunk):
        rows, row_targets = hidden[start : start + chunk], targets[start : start + chunk]
        if torch.is_grad_enabled():
            pieces.append(checkpoint(_chunk_logprobs, rows, row_targets, lm_head, softcap, temperature,
                                     use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(rows, row_targets, lm_head, softcap, temperature))
    if not pieces:
        return torch.zeros((0,), dtype=torch.float32, device=hidden.device)
    return torch.cat(pieces)
