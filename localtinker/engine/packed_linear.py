"""Frozen linear layers through oneDNN with their weights packed once, for sampling.

``F.linear`` hands every call to an sgemm that re-packs the weight matrix into its blocked layout each
time; with the few rows of a decode step that packing is most of the call (the unembedding ran
faster packed on an AVX2 EPYC; docs/engine-notes.md). Which one wins depends on the CPU and the shape, so
:func:`pack_frozen_linears` times both at a model's first sampling (the decode batch calls it), per
weight shape, with 32 rows (a decode step) and 128 (a prefill), and packs a weight only where the
packed kernel wins clearly with few rows (≥ 10%) and is no slower with many (≤ 5%): near-ties, whose
outcome varies from run to run, stay with ``F.linear``. The margin must sit below the real wins, or a
layer is packed in one process and not in the next.

A packed weight serves every call of that layer, whatever its row count, so a row's output never
depends on the rows beside it (the packed kernel is batch-invariant; tested) and a request samples the
same tokens alone or in a crowd. Only inside :func:`packed_sampling` (the decode batch enters it) and
only without autograd: the packed kernel sums in another order (logits differ from ``F.linear`` by
~1e-5) and has no backward of its own; the trainer makes its own measured choice with a backward
(packed_training.py), and where both pack a layer they share the packed W.
Costs one extra copy of each packed weight (the unembedding's is 113 MB on SmolLM2-135M).

bf16 weights of a model that computes in bf16 (bf16_matmul.py) are probed and packed the same way; the
packed bf16 kernel is batch-invariant like the float32 one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from localtinker.engine.bf16_matmul import bf16_matmul_is_fast

_PROBE_ROWS = (32, 128)  # a decode step, a prefill
_PROBE_REPEATS = 3  # after one warm-up round; a few seconds for SmolLM2's shapes, once per process
_MIN_GAIN = 0.10  # with few rows the packed kernel must be this much faster ...
_MAX_LOSS = 0.05  # ... and with many rows at most this much slower
PACKED_ATTR = "_localtinker_packed"  # on a packed layer: its packed weight
TRAIN_PACKED_ATTR = "_localtinker_train_packed"  # (packed W, packed Wᵀ) of the trainer (packed_training.py)
_CHOICES = "_localtinker_packing_choices"  # on the model: {(out, in): packed}, once packed

_state = threading.local()


def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build (and, for bf16, this CPU: oneDNN's bf16 kernels need AVX-512) packs ``dtype``."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def in_packed_sampling() -> bool:
    """True inside :func:`packed_sampling` on this thread (sampling-only kernels may run)."""
    return getattr(_state, "active", False)


@contextmanager
def packed_sampling() -> Iterator[None]:
    """Frozen linears use their packed weights (where measured faster) inside this block, on this thread."""
    previous = getattr(_state, "active", False)
    _state.active = True
    try:
        yield
    finally:
        _state.active = previous


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out × in] in oneDNN's packed layout (an opaque tensor for :func:`packed_linear`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PROBE_ROWS[0])


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedFrozenLinear(torch.autograd.Function):
    """x·Wᵀ + b through a packed W; the backward gives x's gradient through the packed Wᵀ (W is frozen, so
    it has no gradient of its own). The trainer's packed layers (packed_training.py) and the bf16
    unembedding (bf16_head.py) both run through it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, packed: torch.Tensor, packed_t: torch.Tensor, bias: torch.Tensor | None):
        ctx.packed_t = packed_t
        return packed_linear(x, packed, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return packed_linear(grad, ctx.packed_t), None, None, None


def pack_frozen_linears(model: torch.nn.Module, measure: bool = True) -> dict[tuple[int, int], bool]:
    """Packs the frozen float32 linears of the base model (never a LoRA factor, whose weights change), and
    its bf16 ones where bf16 matmuls are native, whose shape the packed kernel runs clearly faster, and
    routes their forward through :func:`_forward`.

    Done once per model (later calls return the first choices). ``measure=False`` packs every one
    (tests exercise the packed path that way on any CPU). Returns {(out, in): packed}.
    """

    def install(module: torch.nn.Linear) -> None:
        trainer = getattr(module, TRAIN_PACKED_ATTR, None)  # the same packed W, when the trainer has one
        setattr(module, PACKED_ATTR, trainer[0] if trainer is not None else pack_weight(module.weight))
        plain_forward = module.forward
        module.forward = lambda x, _m=module, _plain=plain_forward: _forward(_m, _plain, x)

    return pack_by_shape(model, _CHOICES, _packed_wins if measure else None, install, packable_dtypes(model))


def packable_dtypes(model: torch.nn.Module) -> tuple[torch.dtype, ...]:
    """float32, and bf16 where ``model`` holds bf16 linears that compute in bf16 (bf16_matmul.py) and oneDNN
    has bf16 kernels. A float32 model never triggers the bf16 measurement (slow where bf16 is emulated)."""
    has_bf16 = any(isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.bfloat16 for m in model.modules())
    if has_bf16 and packing_available(torch.bfloat16) and bf16_matmul_is_fast():
        return (torch.float32, torch.bfloat16)
    return (torch.float32,)


def pack_by_shape(
    model: torch.nn.Module,
    choices_attr: str,
    wins: Callable[[torch.Tensor], bool] | None,
    install: Callable[[torch.nn.Linear], None],
    dtypes: tuple[torch.dtype, ...] = (torch.float32,),
) -> dict[tuple[int, int], bool]:
    """Calls ``install`` on every frozen linear of ``model`` with weights in one of ``dtypes`` (never a LoRA
    factor) whose weight shape ``wins`` (timed once per shape; None = every shape) chooses; once per model,
    the choices kept in ``choices_attr`` on it. Shared by the sampler's packing (here) and the trainer's
    (packed_training.py). A model's frozen linears of one shape share one dtype, so shape is the key."""
    done = getattr(model, choices_attr, None)
    if done is not None:
        return done
    choices: dict[tuple[int, int], bool] = {}
    if packing_available():
        for name, module in model.named_modules():
            if (not isinstance(module, torch.nn.Linear) or ".lora_" in f".{name}" or module.weight.requires_grad
                    or module.weight.dtype not in dtypes or getattr(module, "packs_itself", False)):
                continue
            shape = tuple(module.weight.shape)
            if shape not in choices:
                choices[shape] = wins(module.weight) if wins is not None else True
            if choices[shape]:
                install(module)
    setattr(model, choices_attr, choices)
    return choices


def best_interleaved_seconds(plain: Callable[[], object], packed: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(plain, packed) best seconds of ``repeats`` interleaved rounds after one warm-up round, without autograd."""
    plain_best = packed_best = float("inf")
    with torch.inference_mode():
        for repeat in range(repeats + 1):
            start = time.perf_counter()
            plain()
            middle = time.perf_counter()
            packed()
            end = time.perf_counter()
            if repeat:  # the first round warms both up
                plain_best, packed_best = min(plain_best, middle - start), min(packed_best, end - middle)
    return plain_best, packed_best


def _forward(module: torch.nn.Linear, plain_forward, x: torch.Tensor) -> torch.Tensor:
    if in_packed_sampling() and not torch.is_grad_enabled() and x.dtype == module.weight.dtype and x.numel():
        return packed_linear(x, getattr(module, PACKED_ATTR), module.bias)
    return plain_forward(x)


def _packed_wins(weight: torch.Tensor) -> bool:
    packed = pack_weight(weight)
    few, many = (_seconds(weight, packed, rows) for rows in _PROBE_ROWS)
    return few[1] < (1 - _MIN_GAIN) * few[0] and many[1] < (1 + _MAX_LOSS) * many[0]


def _seconds(weight: torch.Tensor, packed: torch.Tensor, rows: int) -> tuple[float, float]:
    """(F.linear, packed) best of a few interleaved timings on ``rows`` random rows."""
    x = torch.randn(rows, weight.shape[1]).to(weight.dtype)
    return best_interleaved_seconds(
        lambda: torch.nn.functional.linear(x, weight), lambda: packed_linear(x, packed), _PROBE_REPEATS
    )
