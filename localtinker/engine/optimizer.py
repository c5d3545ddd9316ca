"""AdamW exactly as ``tinker.AdamParams`` describes it, with state we can checkpoint and restore.

Same arithmetic as ``torch.optim.AdamW`` (decoupled weight decay ``p -= lr·wd·p``, bias-corrected
moments, ``eps`` added after the bias-corrected square root), preceded by global-norm gradient
clipping like ``torch.nn.utils.clip_grad_norm_`` when ``grad_clip_norm > 0``. The hyperparameters
come with every ``optim_step`` (clients schedule the learning rate), so the state is the step count
and, per tensor, the two moments and that tensor's own step count.

Like ``torch.optim.AdamW``, a parameter that received no gradient since the last step (``grad is
None``, e.g. an optim_step with no forward_backward before it) is left untouched: no weight decay,
no moment update, no momentum drift, and its bias correction counts only the steps it took part in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from localtinker.engine.api import AdamSpec, EngineUserError, adam_spec_problems

_MOMENT_KINDS = ("exp_avg", "exp_avg_sq")


@dataclass
class AdamState:
    step: int = 0  # optim_step calls so far (the checkpoint's step)
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)
    param_steps: dict[str, int] = field(default_factory=dict)  # updates each tensor took part in

    def to_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {f"exp_avg/{key}": value for key, value in self.exp_avg.items()}
        tensors.update({f"exp_avg_sq/{key}": value for key, value in self.exp_avg_sq.items()})
        tensors.update({f"param_step/{key}": torch.tensor(n, dtype=torch.int64) for key, n in self.param_steps.items()})
        return tensors

    @classmethod
    def from_tensors(cls, step: int, tensors: dict[str, torch.Tensor]) -> "AdamState":
        """Checkpoints written before per-tensor step counts existed count ``step`` for every tensor."""
        state = cls(step=step)
        for key, value in tensors.items():
            kind, _, name = key.partition("/")
            if kind == "param_step":
                state.param_steps[name] = int(value)
            elif kind in _MOMENT_KINDS:
                getattr(state, kind)[name] = value.float().clone()
            else:
                raise EngineUserError(f"optimizer state entry {key!r} is not an AdamW tensor; the checkpoint is corrupt.")
        for name in state.exp_avg:
            state.param_steps.setdefault(name, step)
        return state


def validate_adam(spec: AdamSpec) -> None:
    problems = adam_spec_problems(spec)
    if problems:
        raise EngineUserError("; ".join(problems) + ".")


@torch.no_grad()
def adamw_step(params: dict[str, torch.nn.Parameter], state: AdamState, spec: AdamSpec,
               foreach: bool = False) -> dict[str, float]:
    """Applies one AdamW update to the ``params`` that have a ``.grad``, then clears grads. ``foreach``: the same
    arithmetic in multi-tensor kernels (:func:`_foreach_update`), for a GPU, where the per-tensor loop's ~10
    launches per LoRA tensor (224 tensors on a 1B model) cost more than the arithmetic."""
    validate_adam(spec)
    grads = {key: p.grad.float() for key, p in params.items() if p.grad is not None}
    if foreach and grads:  # one multi-tensor kernel, not one launch per tensor
        norms = list(torch._foreach_norm(list(grads.values())))
    else:
        norms = [torch.linalg.vector_norm(g) for g in grads.values()]
    grad_norm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
    if spec.grad_clip_norm > 0:
        clip_coef = min(1.0, spec.grad_clip_norm / (grad_norm + 1e-6))
        if clip_coef < 1.0:
            grads = {key: g * clip_coef for key, g in grads.items()}
    state.step += 1
    if foreach and grads:
        update_sq = _foreach_update(params, grads, state, spec)
        return {"grad_norm": grad_norm, "learning_rate": spec.learning_rate, "update_norm": math.sqrt(update_sq),
                "step": float(state.step)}
    updates = []  # squared update per tensor, summed once at the end: one device sync per step, not per tensor
    for key, grad in grads.items():
        param = params[key]
        step = state.param_steps.get(key, 0) + 1
        state.param_steps[key] = step
        exp_avg, exp_avg_sq = _moments(state, key, grad)
        exp_avg.lerp_(grad, 1 - spec.beta1)
        exp_avg_sq.mul_(spec.beta2).addcmul_(grad, grad, value=1 - spec.beta2)
        before = param.detach().clone()
        param.mul_(1 - spec.learning_rate * spec.weight_decay)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - spec.beta2**step)).add_(spec.eps)
        param.addcdiv_(exp_avg, denom, value=-spec.learning_rate / (1 - spec.beta1**step))
        updates.append((param - before).pow(2).sum())
        param.grad = None
    update_sq = float(torch.stack(updates).double().sum()) if updates else 0.0
    return {
        "grad_norm": grad_norm,
        "learning_rate": spec.learning_rate,
        "update_norm": math.sqrt(update_sq),
        "step": float(state.step),
    }


def _moments(state: AdamState, key: str, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``key``'s two moments, created as zeros at its first update (not allocated at every step only to be
    dropped, as ``setdefault(key, zeros_like(...))`` would: 448 allocations per step on a 1B model)."""
    if key not in state.exp_avg:
        state.exp_avg[key] = torch.zeros_like(grad)
        state.exp_avg_sq[key] = torch.zeros_like(grad)
    return state.exp_avg[key], state.exp_avg_sq[key]


def _foreach_update(params: dict[str, torch.nn.Parameter], grads: dict[str, torch.Tensor], state: AdamState,
                    spec: AdamSpec) -> float:
    """The loop of :func:`adamw_step` over all tensors at once; returns the squared update norm. Every operation,
    the update's norm included, is a multi-tensor kernel, and the bias corrections are plain numbers when all
    tensors took part in the same number of steps (the usual case): a list of them costs a launch per tensor."""
    keys = list(grads)
    steps = []
    for key in keys:
        steps.append(state.param_steps.get(key, 0) + 1)
        state.param_steps[key] = steps[-1]
    values = [params[key].detach() for key in keys]
    gradients = [grads[key] for key in keys]
    moments = [_moments(state, key, grads[key]) for key in keys]
    first = [moment[0] for moment in moments]
    second = [moment[1] for moment in moments]
    torch._foreach_lerp_(first, gradients, 1 - spec.beta1)
    torch._foreach_mul_(second, spec.beta2)
    torch._foreach_addcmul_(second, gradients, gradients, value=1 - spec.beta2)
    before = torch._foreach_mul(values, 1.0)
    torch._foreach_mul_(values, 1 - spec.learning_rate * spec.weight_decay)
    denominators = torch._foreach_sqrt(second)
    corrections = [math.sqrt(1 - spec.beta2**step) for step in steps]
    step_sizes = [-spec.learning_rate / (1 - spec.beta1**step) for step in steps]
    if len(set(steps)) == 1:
        corrections, step_sizes = corrections[0], step_sizes[0]
    torch._foreach_div_(denominators, corrections)
    torch._foreach_add_(denominators, spec.eps)
    torch._foreach_addcdiv_(values, first, denominators, step_sizes)
    torch._foreach_sub_(before, values)
    norms = torch._foreach_norm(before)
    for key in keys:
        params[key].grad = None
    return float(torch.stack(norms).double().pow(2).sum())
