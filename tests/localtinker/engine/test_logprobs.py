"""The fused target-logprob op against plain autograd."""

from __future__ import annotations

import pytest
import torch

from localtinker.engine.logprobs import TargetLogprob


@pytest.mark.parametrize("rows", [7, 37])  # one pass of rows; several, the last one partial
def test_target_logprob_value_and_gradient_match_autograd(rows):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, 50, dtype=torch.float64, generator=generator, requires_grad=True)
    targets = torch.randint(0, 50, (rows,), generator=generator)
    weights = torch.randn(rows, dtype=torch.float64, generator=generator)
    fused = TargetLogprob.apply(logits, targets)
    (fused * weights).sum().backward()
    fused_grad = logits.grad.clone()
    logits.grad = None
    plain = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    (plain * weights).sum().backward()
    torch.testing.assert_close(fused, plain)
    torch.testing.assert_close(fused_grad, logits.grad)
    assert torch.autograd.gradcheck(TargetLogprob.apply, (logits[:7].detach().requires_grad_(), targets[:7]))
