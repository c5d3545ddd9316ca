"""The trainer's frozen linears through oneDNN with packed weights, forward and input gradient.

``F.linear`` runs on the BLAS torch ships (MKL), which on some CPUs leaves speed on the table (oneDNN's
packed kernel was 10-20% faster on a Zen 4 EPYC, a tie on an AVX2 one; docs/engine-notes.md). So, once per model
and weight shape, :func:`pack_for_training` times a training micro-batch's two products through that
weight, the forward x·Wᵀ and the input gradient g·W, both ways, and packs where oneDNN wins by ≥ 5%.

A LoRA step never updates the frozen weights, so each chosen layer keeps two packed copies, W for the
forward and Wᵀ for the backward (its weight gradient is never needed): +2 × 4 bytes per weight, ~1 GB
on SmolLM2-135M if every shape is chosen; the sampler's packed copy of W (packed_linear.py) is the same
tensor. Every trainer pass of a packed layer takes the packed kernel, with or without autograd, so
``forward`` and ``forward_backward`` logprobs stay identical; sampling keeps its own choice.

Where bf16 is native (bf16_matmul.py) the bf16 weights of a ``dtype="bfloat16"`` model are probed and
packed the same way, in bf16, where the gain is small (a few %, bench/bench_engine_train.py).
"""

from __future__ import annotations

import torch

from localtinker.engine.packed_linear import (
    PACKED_ATTR,
    TRAIN_PACKED_ATTR,
    PackedFrozenLinear,
    best_interleaved_seconds,
    in_packed_sampling,
    pack_by_shape,
    pack_weight,
    packable_dtypes,
    packed_linear,
)

_CHOICES = "_localtinker_train_packing_choices"  # on the model: {(out, in): packed}, once decided
_PROBE_ROWS = 128  # rows per probe product: the unembedding (49152 × 576) is the costly one
_PROBE_MAX_OUT = 8192
_PROBE_REPEATS = 3
_MIN_GAIN = 0.05

# Set to False to train through F.linear everywhere (A/B comparisons).
ENABLED = True


def pack_for_training(model: torch.nn.Module, measure: bool = True) -> dict[tuple[int, int], bool]:
    """Packs the frozen float32 linears (and bf16 ones where bf16 is native; never a LoRA factor) of ``model``
    whose shape oneDNN runs clearly faster (see the module docstring), once per model; ``measure=False`` packs every one (tests).
    Returns {(out, in): packed}."""

    def install(module: torch.nn.Linear) -> None:
        weight = module.weight.detach()
        sampler = getattr(module, PACKED_ATTR, None)  # the same packed W, when the sampler has one
        packed = sampler if sampler is not None else pack_weight(weight)
        setattr(module, TRAIN_PACKED_ATTR, (packed, pack_weight(weight.t().contiguous())))
        inner = module.forward
        module.forward = lambda x, _m=module, _inner=inner: _forward(_m, _inner, x)

    return pack_by_shape(model, _CHOICES, forward_and_gradient_pack_wins if measure else None, install, packable_dtypes(model))


def _forward(module: torch.nn.Linear, inner, x: torch.Tensor) -> torch.Tensor:
    packed, packed_t = getattr(module, TRAIN_PACKED_ATTR)
    if not ENABLED or in_packed_sampling() or x.dtype != module.weight.dtype or not x.numel():
        return inner(x)
    if torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad):
        return PackedFrozenLinear.apply(x, packed, packed_t, module.bias)
    return packed_linear(x, packed, module.bias)


def forward_and_gradient_pack_wins(weight: torch.Tensor) -> bool:
    """Forward + input-gradient seconds of ``_PROBE_ROWS`` rows, F.linear vs packed, best of interleaved runs, in
    ``weight``'s dtype. Also decides the bf16 unembedding's packing (bf16_head.py)."""
    weight = weight[:_PROBE_MAX_OUT]  # the unembedding's first rows: the same kernels, 1/6 of the probe's time
    packed, packed_t = pack_weight(weight), pack_weight(weight.t().contiguous())
    x = torch.randn(_PROBE_ROWS, weight.shape[1]).to(weight.dtype)
    grad = torch.randn(_PROBE_ROWS, weight.shape[0]).to(weight.dtype)

    def plain() -> None:
        torch.nn.functional.linear(x, weight)
        torch.mm(grad, weight)

    def packed_pair() -> None:
        packed_linear(x, packed)
        packed_linear(grad, packed_t)

    plain_best, packed_best = best_interleaved_seconds(plain, packed_pair, _PROBE_REPEATS)
    return packed_best < (1 - _MIN_GAIN) * plain_best
