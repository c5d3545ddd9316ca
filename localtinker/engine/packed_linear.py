"""Frozen float32 linear layers through oneDNN with their weights packed once, for sampling.

``F.linear`` hands every call to an sgemm that re-packs the weight matrix into its blocked layout each
time; with the few rows of a decode step that packing is most of the call. Measured on a 2-core AVX2
EPYC, one thread: the unembedding, [32 × 576] × [576 × 49152], ran at 27 GFLOP/s through ``F.linear``
and 49 with the weight packed once by oneDNN; the 1536-wide MLP projections at 51 vs 64. With many
rows (prefill) the plain call is as fast or faster. Which one wins depends on the CPU and the shape, so
:func:`pack_frozen_linears` measures both when the model loads, per weight shape and for few (decode)
and many (prefill) rows, and the packed kernel is used only where it won.

Only inside :func:`packed_sampling` (the decode batch enters it) and only without autograd: the packed
kernel sums in another order (logits differ from ``F.linear`` by ~1e-5) and has no backward, so
training and the trainer's logprobs keep ``F.linear`` bit for bit. It is batch-invariant (a row's output
does not depend on the other rows), so a request samples the same tokens alone or in a crowd.
Costs one extra copy of each packed weight (the unembedding's is 113 MB on SmolLM2-135M).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

FEW_ROWS = 64  # a call with at most this many rows (a decode step) counts as "few"
_PROBE_ROWS = {"few": 32, "many": 128}
_PROBE_REPEATS = 3  # after one warm-up round; SmolLM2's shapes take ~1.5 s in all, once per process
_MIN_GAIN = 0.10  # packed must be this much faster to be chosen: near-ties go to F.linear (no extra memory)
_ATTRIBUTE = "_localtinker_packed"

_state = threading.local()


@dataclass(frozen=True)
class PackedWeight:
    weight: torch.Tensor  # oneDNN's opaque packed layout
    few_rows: bool  # use it for calls with <= FEW_ROWS rows
    many_rows: bool  # ... and for larger calls


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@contextmanager
def packed_sampling() -> Iterator[None]:
    """Frozen linears use their packed weights (where measured faster) inside this block, on this thread."""
    previous = getattr(_state, "active", False)
    _state.active = True
    try:
        yield
    finally:
        _state.active = previous


def pack_frozen_linears(model: torch.nn.Module, measure: bool = True) -> dict[tuple[int, int], tuple[bool, bool]]:
    """Packs the frozen float32 linears of the base model (never a LoRA factor, whose weights change)
    whose shape the packed kernel runs faster, and routes their forward through :func:`_forward`.

    Done once per model (later calls return the first choices). ``measure=False`` packs every one for
    every row count (tests exercise the packed path that way on any CPU). Returns
    {(out, in): (packed for few rows, packed for many rows)}.
    """
    done = getattr(model, _ATTRIBUTE, None)
    if done is not None:
        return done
    choices: dict[tuple[int, int], tuple[bool, bool]] = {}
    if packing_available():
        for name, module in model.named_modules():
            if (not isinstance(module, torch.nn.Linear) or ".lora_" in f".{name}" or module.weight.requires_grad
                    or module.weight.dtype != torch.float32 or hasattr(module, _ATTRIBUTE)):
                continue
            shape = tuple(module.weight.shape)
            packed = None
            if shape not in choices:
                packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), _PROBE_ROWS["few"])
                choices[shape] = (
                    (_packed_faster(module.weight, packed, _PROBE_ROWS["few"]),
                     _packed_faster(module.weight, packed, _PROBE_ROWS["many"])) if measure else (True, True)
                )
            few, many = choices[shape]
            if few or many:
                if packed is None:
                    packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), _PROBE_ROWS["few"])
                setattr(module, _ATTRIBUTE, PackedWeight(packed, few, many))
                plain_forward = module.forward
                module.forward = lambda x, _m=module, _plain=plain_forward: _forward(_m, _plain, x)
    setattr(model, _ATTRIBUTE, choices)
    return choices


def _forward(module: torch.nn.Linear, plain_forward, x: torch.Tensor) -> torch.Tensor:
    packed: PackedWeight = getattr(module, _ATTRIBUTE)
    if getattr(_state, "active", False) and not torch.is_grad_enabled() and x.dtype == torch.float32:
        rows = x.numel() // x.shape[-1]
        if rows and (packed.few_rows if rows <= FEW_ROWS else packed.many_rows):
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.weight, module.bias, "none", [], "")
    return plain_forward(x)


def _packed_faster(weight: torch.Tensor, packed: torch.Tensor, rows: int) -> bool:
    """Best of a few interleaved timings of ``F.linear`` and the packed kernel on random rows."""
    x = torch.randn(rows, weight.shape[1])
    plain_best = packed_best = float("inf")
    with torch.inference_mode():
        for repeat in range(_PROBE_REPEATS + 1):
            start = time.perf_counter()
            torch.nn.functional.linear(x, weight)
            middle = time.perf_counter()
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            end = time.perf_counter()
            if repeat:  # the first round warms both up
                plain_best, packed_best = min(plain_best, middle - start), min(packed_best, end - middle)
    return packed_best < (1 - _MIN_GAIN) * plain_best
