"""AdamW exactly as ``tinker.AdamParams`` describes it, with state we can checkpoint and restore.

Same arithmetic as ``torch.optim.AdamW`` (decoupled weight decay ``p -= lr·wd·p``, bias-corrected
moments, ``eps`` added after the bias-corrected square root), preceded by global-norm gradient
clipping like ``torch.nn.utils.clip_grad_norm_`` when ``grad_clip_norm > 0``. The hyperparameters
come with every ``optim_step`` (clients schedule the learning rate), so the state is just the step
count and the two moments per tensor.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from localtinker.engine.api import AdamSpec, EngineUserError


@dataclass
class AdamState:
    step: int = 0
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {f"exp_avg/{key}": value for key, value in self.exp_avg.items()}
        tensors.update({f"exp_avg_sq/{key}": value for key, value in self.exp_avg_sq.items()})
        return tensors

    @classmethod
    def from_tensors(cls, step: int, tensors: dict[str, torch.Tensor]) -> "AdamState":
        state = cls(step=step)
        for key, value in tensors.items():
            kind, _, name = key.partition("/")
            getattr(state, kind)[name] = value.float().clone()
        return state


def validate_adam(spec: AdamSpec) -> None:
    checks = [
        ("learning_rate", spec.learning_rate, lambda v: v >= 0, ">= 0"),
        ("beta1", spec.beta1, lambda v: 0 <= v < 1, "in [0, 1)"),
        ("beta2", spec.beta2, lambda v: 0 <= v < 1, "in [0, 1)"),
        ("eps", spec.eps, lambda v: v > 0, "> 0"),
        ("weight_decay", spec.weight_decay, lambda v: v >= 0, ">= 0"),
        ("grad_clip_norm", spec.grad_clip_norm, lambda v: v >= 0, ">= 0 (0 disables clipping)"),
    ]
    for name, value, ok, rule in checks:
        if not isinstance(value, numbers.Real) or not math.isfinite(value) or not ok(value):
            raise EngineUserError(f"AdamParams.{name} must be finite and {rule}, got {value!r}.")


@torch.no_grad()
def adamw_step(params: dict[str, torch.nn.Parameter], state: AdamState, spec: AdamSpec) -> dict[str, float]:
    """Applies one AdamW update to ``params`` from their ``.grad`` (None counts as zero), then clears grads."""
    validate_adam(spec)
    grads = {key: (p.grad if p.grad is not None else torch.zeros_like(p)).float() for key, p in params.items()}
    grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])).item()
    if spec.grad_clip_norm > 0:
        clip_coef = min(1.0, spec.grad_clip_norm / (grad_norm + 1e-6))
        if clip_coef < 1.0:
            grads = {key: g * clip_coef for key, g in grads.items()}
    state.step += 1
    bias_correction1 = 1 - spec.beta1**state.step
    bias_correction2_sqrt = math.sqrt(1 - spec.beta2**state.step)
    step_size = spec.learning_rate / bias_correction1
    update_sq = 0.0
    for key, param in params.items():
        grad = grads[key]
        exp_avg = state.exp_avg.setdefault(key, torch.zeros_like(grad))
        exp_avg_sq = state.exp_avg_sq.setdefault(key, torch.zeros_like(grad))
        exp_avg.lerp_(grad, 1 - spec.beta1)
        exp_avg_sq.mul_(spec.beta2).addcmul_(grad, grad, value=1 - spec.beta2)
        before = param.detach().clone()
        param.mul_(1 - spec.learning_rate * spec.weight_decay)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(spec.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
        update_sq += float((param - before).pow(2).sum())
        param.grad = None
    return {
        "grad_norm": grad_norm,
        "learning_rate": spec.learning_rate,
        "update_norm": math.sqrt(update_sq),
        "step": float(state.step),
    }
