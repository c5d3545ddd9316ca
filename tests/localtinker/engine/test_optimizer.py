"""AdamW on parameters that sometimes get no gradient, against torch.optim.AdamW (which skips them)."""

from __future__ import annotations

import pytest
import torch

from localtinker.engine.api import AdamSpec
from localtinker.engine.optimizer import AdamState, adamw_step

HYPER = AdamSpec(learning_rate=0.05, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1)


def test_parameters_without_grad_are_untouched_like_torch_adamw():
    """Step pattern per tensor: 'a' gets grads at every step, 'b' only at steps 0 and 3 (a LoRA tensor the
    loss did not reach has grad None). 'b' must not decay nor drift on momentum in between, and its bias
    correction must count its own 2 updates, exactly as torch.optim.AdamW does; state survives a checkpoint."""
    generator = torch.Generator().manual_seed(0)
    initial = {"a": torch.randn(3, 4, generator=generator), "b": torch.randn(5, generator=generator)}
    ours = {k: torch.nn.Parameter(v.clone()) for k, v in initial.items()}
    theirs = {k: torch.nn.Parameter(v.clone()) for k, v in initial.items()}
    optimizer = torch.optim.AdamW(
        theirs.values(), lr=HYPER.learning_rate, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps, weight_decay=HYPER.weight_decay
    )
    state = AdamState()
    for step in range(5):
        grads = {"a": torch.randn(3, 4, generator=generator)}
        if step in (0, 3):
            grads["b"] = torch.randn(5, generator=generator)
        for name in initial:
            ours[name].grad = grads[name].clone() if name in grads else None
            theirs[name].grad = grads[name].clone() if name in grads else None
        b_before = ours["b"].detach().clone()
        adamw_step(ours, state, HYPER)
        optimizer.step()
        if "b" not in grads:
            assert torch.equal(ours["b"].detach(), b_before)
        for name in initial:
            torch.testing.assert_close(ours[name].detach(), theirs[name].detach(), rtol=1e-6, atol=1e-7)
        state = AdamState.from_tensors(state.step, state.to_tensors())  # a checkpoint round trip each step
    assert state.step == 5 and state.param_steps == {"a": 5, "b": 2}


def test_optim_step_with_no_gradient_at_all_changes_nothing():
    param = torch.nn.Parameter(torch.ones(4))
    state = AdamState()
    param.grad = torch.full((4,), 0.5)
    adamw_step({"p": param}, state, HYPER)
    after_first = param.detach().clone()
    moments = {k: v.clone() for k, v in state.to_tensors().items()}
    metrics = adamw_step({"p": param}, state, HYPER)
    assert torch.equal(param.detach(), after_first)
    assert all(torch.equal(moments[k], v) for k, v in state.to_tensors().items())
    assert metrics["grad_norm"] == 0.0 and metrics["update_norm"] == 0.0


def test_old_checkpoints_without_per_tensor_steps_count_the_global_step():
    tensors = {"exp_avg/p": torch.zeros(2), "exp_avg_sq/p": torch.zeros(2)}
    assert AdamState.from_tensors(7, tensors).param_steps == {"p": 7}


def test_foreach_update_equals_the_loop():
    """The GPU path's multi-tensor AdamW (``foreach=True``) is the loop's arithmetic, tensor for tensor,
    including per-tensor step counts (one tensor skips a step) and weight decay; its gradient norm too."""
    generator = torch.Generator().manual_seed(0)
    shapes = {"a": (3, 4), "b": (5,), "c": (2, 2)}
    weights = {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}
    runs = {}
    for foreach in (False, True):
        params = {key: torch.nn.Parameter(value.clone()) for key, value in weights.items()}
        state = AdamState()
        metrics = []
        for step in range(3):
            for key, param in params.items():
                param.grad = None if (step == 1 and key == "b") else torch.randn(param.shape, generator=torch.Generator().manual_seed(step))
            metrics.append(adamw_step(params, state, AdamSpec(learning_rate=0.1, weight_decay=0.01), foreach=foreach))
        runs[foreach] = (params, state, metrics)
    (loop, loop_state, loop_metrics), (multi, multi_state, multi_metrics) = runs[False], runs[True]
    for key in shapes:
        torch.testing.assert_close(multi[key], loop[key], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(multi_state.exp_avg_sq[key], loop_state.exp_avg_sq[key], rtol=1e-6, atol=1e-9)
    assert multi_state.param_steps == loop_state.param_steps == {"a": 3, "b": 2, "c": 3}
    for a, b in zip(multi_metrics, loop_metrics):
        assert a["update_norm"] == pytest.approx(b["update_norm"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)  # one multi-tensor norm kernel
