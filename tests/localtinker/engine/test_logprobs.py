"""The fused target-logprob op against plain autograd; the choice of the logits a bf16 head refines."""

from __future__ import annotations

import pytest
import torch

from localtinker.engine.bf16_head import REFINED_TOKENS
from localtinker.engine.logprobs import SELECTION_BLOCK, TargetLogprob, _refined_columns


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


BLOCKED_VOCAB = 4 * REFINED_TOKENS * SELECTION_BLOCK  # the smallest vocabulary selected by blocks


@pytest.mark.parametrize("vocab", [BLOCKED_VOCAB, 49152, BLOCKED_VOCAB + 5, 300])  # blocks; whole rows
def test_refined_columns_are_the_largest_logits_of_each_row(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(70, vocab, generator=generator) * 3).to(torch.bfloat16)  # bf16: ties at the 32nd place
    chosen = _refined_columns(logits)
    assert chosen.shape == (70, REFINED_TOKENS)
    assert all(len(set(row.tolist())) == REFINED_TOKENS for row in chosen)
    # The values taken are the row's 32 largest (which of several tied at the 32nd place is free).
    taken = logits.float().gather(-1, chosen).sort(dim=-1).values
    torch.testing.assert_close(taken, logits.float().topk(REFINED_TOKENS, dim=-1).values.sort(dim=-1).values,
                               rtol=0, atol=0)
    distinct = torch.randn(70, vocab, generator=generator)  # no ties: exactly torch.topk's ids
    assert torch.equal(_refined_columns(distinct).sort(dim=-1).values,
                       distinct.topk(REFINED_TOKENS, dim=-1).indices.sort(dim=-1).values)


def test_refined_columns_agree_between_bf16_logits_and_their_float32_copy_row_by_row():
    """The trainer selects on bf16 logits, the sampler on its float32 copy, a row alone or among others."""
    logits = (torch.randn(45, BLOCKED_VOCAB, generator=torch.Generator().manual_seed(3)) * 3).to(torch.bfloat16)
    together = _refined_columns(logits)
    assert torch.equal(_refined_columns(logits.float()), together)
    for row in (0, 31, 32, 44):
        assert torch.equal(_refined_columns(logits[row : row + 1])[0], together[row])
