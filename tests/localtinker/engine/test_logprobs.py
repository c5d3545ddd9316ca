"""The fused target-logprob op against plain autograd."""

from __future__ import annotations

import torch

from localtinker.engine.logprobs import TargetLogprob


def test_target_logprob_value_and_gradient_match_autograd():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 50, dtype=torch.float64, generator=generator, requires_grad=True)
    targets = torch.randint(0, 50, (7,), generator=generator)
    weights = torch.randn(7, dtype=torch.float64, generator=generator)
    fused = TargetLogprob.apply(logits, targets)
    (fused * weights).sum().backward()
    fused_grad = logits.grad.clone()
    logits.grad = None
    plain = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    (plain * weights).sum().backward()
    torch.testing.assert_close(fused, plain)
    torch.testing.assert_close(fused_grad, logits.grad)
    assert torch.autograd.gradcheck(TargetLogprob.apply, (logits.detach().requires_grad_(), targets))
