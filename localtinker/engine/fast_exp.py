"""``exp`` of float32 tensors through ``exp2``: the same values to a few parts per million, faster on CPU (docs/engine-notes.md).

torch's CPU ``exp`` kernel for float32 is several times slower than its ``exp2`` (docs/engine-notes.md, after
Pass 7), and the engine takes an ``exp`` over the whole vocabulary
for every token it trains on (the loss's forward and backward) and every token it samples. So
``exp(x) = exp2(x · log2 e)``: the rounding of the product adds a relative error of at most |x|·2⁻²⁴·log2 e
(3.8e-6 at x = −87, 1.8e-6 over [−30, 0], against 6e-8 for ``exp``), and these callers take ``exp`` of
``x − max(x) ≤ 0``, where the terms that carry the sums have |x| of a few units. Elementwise, so a value
never depends on the batch around it. Float64 (the exactness tests' reference dtype) keeps ``exp``.
"""

from __future__ import annotations

import math

import torch

LOG2E = 1.0 / math.log(2.0)


def exp_(values: torch.Tensor) -> torch.Tensor:
    """``values.exp_()``, through ``exp2`` for float32; returns ``values``."""
    if values.dtype != torch.float32:
        return values.exp_()
    return values.mul_(LOG2E).exp2_()
