"""Whether this CPU multiplies bfloat16 matrices faster than float32 ones: measured once per process.

``dtype="bfloat16"`` keeps the frozen base weights in bf16. Whether its matmuls should also run in
bf16 depends on the CPU, and no flag in /proc/cpuinfo says so reliably: on AVX2-only CPUs torch
emulates bf16 (far slower than float32), some AVX512-BF16 CPUs run it slower than float32 and
others faster (docs/engine-notes.md, precision). So the engine times one layer-shaped product both ways, on the
threads it will use, and computes in bf16 only where that is clearly faster.

``LOCALTINKER_BF16_MATMUL=bfloat16`` or ``=float32`` skips the measurement and forces the choice.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch

logger = logging.getLogger("localtinker")

ENV_CHOICE = "LOCALTINKER_BF16_MATMUL"
# bf16 must beat float32 by this factor: a near-tie is not worth bf16's coarser rounding of activations.
REQUIRED_SPEEDUP = 1.25
_SHAPE = (512, 576, 1536)  # tokens × hidden × MLP width, the bulk of a SmolLM2 training micro-batch
_REPEATS = 5


@functools.cache
def bf16_matmul_is_fast() -> bool:
    """True when bf16 matmuls should be used (see the module docstring); cached for the process."""
    choice = os.environ.get(ENV_CHOICE, "").strip().lower()
    if choice in ("bfloat16", "bf16"):
        return True
    if choice in ("float32", "fp32"):
        return False
    if choice:
        raise ValueError(f"{ENV_CHOICE}={choice!r}: use bfloat16, float32, or leave it unset to measure")
    float32_s, bf16_s = measure_matmul_seconds()
    fast = bf16_s * REQUIRED_SPEEDUP < float32_s
    logger.info(
        "bf16 matmul %.2f ms vs float32 %.2f ms (%.2fx): dtype=bfloat16 computes in %s",
        bf16_s * 1e3, float32_s * 1e3, float32_s / bf16_s, "bfloat16" if fast else "float32",
    )
    return fast


def measure_matmul_seconds() -> tuple[float, float]:
    """Best seconds of one layer-shaped product in (float32, bfloat16), interleaved so load hits both."""
    rows, inner, cols = _SHAPE
    operands = {dtype: (torch.randn(rows, inner).to(dtype), torch.randn(inner, cols).to(dtype))
                for dtype in (torch.float32, torch.bfloat16)}
    best = {dtype: float("inf") for dtype in operands}
    for repeat in range(_REPEATS + 1):
        for dtype, (left, right) in operands.items():
            start = time.perf_counter()
            torch.mm(left, right)
            if repeat:  # the first round warms up kernels and caches
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.float32], best[torch.bfloat16]
