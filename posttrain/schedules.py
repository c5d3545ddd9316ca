"""Learning-rate schedules as multipliers of the base learning rate (cookbook semantics).

The trainer calls :func:`learning_rate_at` once per optimizer step and puts the result into that
step's ``AdamParams``; Tinker has no server-side scheduler, so the schedule lives here. Without warmup
the multipliers are exactly the cookbook's: linear ``1 - step/total``, cosine
``0.5 * (1 + cos(pi * step/total))``, constant ``1``. With ``warmup_steps = W`` the first ``W`` steps
ramp linearly ``(step + 1) / W`` (so step 0 never trains at LR 0) and the decay then runs over the
remaining ``total - W`` steps.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

LRSchedule = Literal["linear", "cosine", "constant"]
LR_SCHEDULES: tuple[str, ...] = get_args(LRSchedule)


def lr_multiplier(schedule: str, step: int, total_steps: int, warmup_steps: int = 0) -> float:
    """The factor applied to the base learning rate at optimizer step ``step`` (0-based)."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr_schedule {schedule!r}: use one of {', '.join(LR_SCHEDULES)}")
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(f"warmup_steps must be in [0, total_steps={total_steps}), got {warmup_steps}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min((step - warmup_steps) / (total_steps - warmup_steps), 1.0)
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


def learning_rate_at(
    base_learning_rate: float, schedule: str, step: int, total_steps: int, warmup_steps: int = 0
) -> float:
    """The learning rate for optimizer step ``step``."""
    return base_learning_rate * lr_multiplier(schedule, step, total_steps, warmup_steps)
