"""The bf16 unembedding with float32-refined top logits: same function as the plain expression, exact where
it is refined, one function for trainer and sampler, and batch-invariant without a LoRA delta."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from localtinker.engine.bf16_head import REFINED_TOKENS, Bf16Head, exact_logits_at, refines_logits
from localtinker.engine.logprobs import (
    SELECTION_BLOCK,
    RefinedTargetLogprob,
    next_token_logit_blocks,
    next_token_logits,
    token_logprobs,
)
from localtinker.engine.packed_linear import packing_available

HIDDEN, VOCAB = 24, 4 * REFINED_TOKENS * SELECTION_BLOCK  # large enough for logprobs._refined_columns to use blocks
PACKING = [False, pytest.param(True, marks=pytest.mark.skipif(
    not packing_available(torch.bfloat16), reason="oneDNN has no bf16 kernels on this CPU"))]


def _head(pack: bool, bias: bool = False, seed: int = 0) -> Bf16Head:
    generator = torch.Generator().manual_seed(seed)
    head = Bf16Head(HIDDEN, VOCAB, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=generator))
        if bias:
            head.bias.copy_(torch.randn(VOCAB, generator=generator))
    head.requires_grad_(False)
    head.prepare(pack=pack)
    return head


def _lora_head(pack: bool, seed: int = 0) -> torch.nn.Module:
    """A peft-wrapped Bf16Head with non-zero B, so the LoRA delta matters. Its factors come from ``seed``,
    not from whatever the global generator holds after the tests before (peft initialises A from it)."""

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = _head(pack, bias=True)

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = get_peft_model(Wrapper(), LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"]))
        with torch.no_grad():
            model.base_model.model.lm_head.lora_B["default"].weight.normal_(0, 0.3)
    return model.base_model.model.lm_head


def _tail_rounding_bound(logits: torch.Tensor) -> torch.Tensor:
    """How far bf16 rounding of the unrefined logits can move a row's log-sum-exp: each is rounded at most twice
    (the bf16 product's output, then the LoRA delta's bf16 add), by at most |z|·2⁻⁸ together, and the
    log-sum-exp moves by the probability-weighted sum of those errors over the logits outside the top
    ``REFINED_TOKENS`` (``logits``: the float32 reference)."""
    probabilities = logits.softmax(-1)
    tail = torch.ones_like(logits, dtype=torch.bool).scatter(-1, logits.topk(REFINED_TOKENS, dim=-1).indices, False)
    return (probabilities * logits.abs() * tail).sum(-1) * 2.0**-8


def _reference_logits(hidden: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
    """float32 logits from the float32 master weights, the LoRA delta in float32: what refinement must match."""
    base = getattr(lm_head, "base_layer", lm_head)
    logits = torch.nn.functional.linear(hidden.float(), base.weight, base.bias)
    if hasattr(lm_head, "lora_A"):
        a, b = lm_head.lora_A["default"].weight, lm_head.lora_B["default"].weight
        logits = logits + hidden.float() @ a.t() @ b.t() * lm_head.scaling["default"]
    return logits


@pytest.mark.parametrize("pack", PACKING)
def test_bulk_logits_are_bf16_and_the_largest_are_exact_float32(pack):
    head = _lora_head(pack)
    assert refines_logits(head) and not refines_logits(torch.nn.Linear(2, 2))
    hidden = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    with torch.no_grad():
        bulk = head(hidden)
        logits = next_token_logits(hidden, head)
    reference = _reference_logits(hidden, head)
    assert bulk.dtype == torch.bfloat16 and logits.dtype == torch.float32
    top = reference.topk(REFINED_TOKENS // 2, dim=-1).indices  # well inside the refined set
    torch.testing.assert_close(logits.gather(-1, top), reference.gather(-1, top), rtol=1e-6, atol=1e-5)
    # Everywhere else within bf16 rounding of the exact value, and the bf16 values really are coarser.
    torch.testing.assert_close(logits, reference, rtol=1e-2, atol=0.1)
    assert (bulk.float() - reference).abs().max() > 1e-3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_refined_target_logprob_matches_autograd_of_the_plain_expression(temperature):
    generator = torch.Generator().manual_seed(1)
    rows = 37  # the loss makes its float32 rows 16 at a time: several passes, the last one partial
    logits = (torch.randn(rows, VOCAB, generator=generator) * 3).to(torch.bfloat16).requires_grad_()
    columns = logits.detach().float().topk(8, dim=-1).indices
    exact = (logits.detach().float().gather(-1, columns) + 0.01 * torch.randn(rows, 8, generator=generator))
    exact.requires_grad_()
    targets = torch.randint(0, VOCAB, (rows,), generator=generator)
    targets[:3] = columns[:3, 2]  # half the targets refined, half not
    weights = torch.randn(rows, generator=generator)

    fused = RefinedTargetLogprob.apply(logits, exact, columns, targets, 1.0 / temperature)
    (fused * weights).sum().backward()
    fused_grads = logits.grad.float(), exact.grad.clone()
    logits.grad = exact.grad = None

    plain_logits = logits.float().scatter(-1, columns, exact) / temperature
    plain = plain_logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    (plain * weights).sum().backward()
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_grads[1], exact.grad, rtol=1e-5, atol=1e-6)
    # The bulk gradient is delivered in bf16: equal to bf16 rounding.
    torch.testing.assert_close(fused_grads[0], logits.grad.float(), rtol=1e-2, atol=1e-4)
    assert fused_grads[0].gather(-1, columns).abs().max() == 0  # refined positions get their gradient via exact


@pytest.mark.parametrize("pack", PACKING)
@pytest.mark.parametrize("seed", [0, 10])
def test_trainer_gradients_reach_hidden_and_lora_factors(pack, seed):
    head = _lora_head(pack, seed)
    generator = torch.Generator().manual_seed(8)
    hidden = torch.randn(5, HIDDEN, generator=generator).to(torch.bfloat16).requires_grad_()
    with torch.no_grad():
        targets = _reference_logits(hidden, head).argmax(dim=-1)  # refined targets ...
    targets[3:] = torch.randint(0, VOCAB, (2,), generator=generator)  # ... and (most likely) unrefined ones
    logprobs = token_logprobs(hidden, head, targets)
    logprobs.sum().backward()
    factors = [head.lora_A["default"].weight, head.lora_B["default"].weight]
    reference_hidden = hidden.detach().float().requires_grad_()
    reference_factors = [f.detach().clone().requires_grad_() for f in factors]
    base = head.base_layer
    reference_logits = torch.nn.functional.linear(reference_hidden, base.weight, base.bias) + (
        reference_hidden @ reference_factors[0].t() @ reference_factors[1].t() * head.scaling["default"])
    reference = reference_logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    reference.sum().backward()
    # A refined target is exact up to the tail's rounding in the log-sum-exp; another carries its bf16 logit.
    # (A fixed 1e-3 once failed by 6e-7: the error grows with the probability outside the top 32, here up to 37%.)
    refined_error = (logprobs[:3].detach().float() - reference[:3].detach()).abs()
    assert (refined_error <= _tail_rounding_bound(reference_logits[:3].detach())).all(), refined_error
    torch.testing.assert_close(logprobs[3:], reference[3:], rtol=0, atol=0.1)
    torch.testing.assert_close(hidden.grad.float(), reference_hidden.grad, rtol=0.05, atol=0.02)
    for factor, expected in zip(factors, reference_factors):
        assert factor.grad is not None
        torch.testing.assert_close(factor.grad, expected.grad, rtol=0.05, atol=0.02)


@pytest.mark.parametrize("pack", PACKING)
def test_sampler_and_trainer_compute_one_function(pack):
    head = _lora_head(pack)
    hidden = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with torch.inference_mode():
        logits = next_token_logits(hidden, head)
        targets = logits.argmax(dim=-1)
        trainer = token_logprobs(hidden, head, targets)
    sampler = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(trainer, sampler, rtol=0, atol=1e-5)


@pytest.mark.parametrize("pack", PACKING)
def test_refined_rows_do_not_depend_on_the_rows_beside_them(pack):
    """The bulk product and the refinement are batch-invariant, over many draws. (An unmerged bf16 LoRA's
    low-rank add is not always: a small GEMM's one-row kernel sums in another order; see bf16_head.py.)"""
    head = _head(pack, bias=True)
    generator = torch.Generator().manual_seed(6)
    for _ in range(50):
        hidden = torch.randn(7, HIDDEN, generator=generator).to(torch.bfloat16)
        with torch.inference_mode():
            together = next_token_logits(hidden, head)
            alone = torch.cat([next_token_logits(hidden[i : i + 1], head) for i in range(len(hidden))])
        # a request scores the same alone or in a crowd, to one bf16 rounding: AMX kernels (Intel) sum a
        # one-row product in another order than a many-row one; AVX-512 kernels (Zen) agree bitwise
        torch.testing.assert_close(alone, together, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("pack", PACKING)
@pytest.mark.parametrize("kind", ["refined", "refined lora", "float32"])
def test_logit_blocks_are_next_token_logits_row_for_row(pack, kind):
    """A decode step takes its logits in blocks of rows (the last one partial): the same values, bit for bit."""
    head = {"refined": lambda: _head(pack, bias=True), "refined lora": lambda: _lora_head(pack),
            "float32": lambda: torch.nn.Linear(HIDDEN, VOCAB)}[kind]()
    hidden = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(8))
    if kind != "float32":
        hidden = hidden.to(torch.bfloat16)
    with torch.inference_mode():
        whole = next_token_logits(hidden, head)
        blocks = [(start, stop, block.clone()) for start, stop, block in next_token_logit_blocks(hidden, head, 4)]
    assert [(start, stop) for start, stop, _ in blocks] == [(0, 4), (4, 8), (8, 11)]
    assert all(block.dtype == torch.float32 for _, _, block in blocks)
    assert torch.equal(torch.cat([block for _, _, block in blocks]), whole)


def test_exact_logits_ignore_disabled_adapters():
    head = _lora_head(pack=False)
    generator = torch.Generator().manual_seed(9)
    hidden = torch.randn(3, HIDDEN, generator=generator)
    columns = torch.randint(0, VOCAB, (3, 5), generator=generator)
    with torch.no_grad():
        with_adapter = exact_logits_at(hidden, head, columns)
        head.enable_adapters(False)
        without = exact_logits_at(hidden, head, columns)
    base = head.base_layer
    torch.testing.assert_close(without, torch.nn.functional.linear(hidden, base.weight, base.bias).gather(-1, columns))
    assert (with_adapter - without).abs().max() > 1e-3
