"""The DPO loss: cookbook yardsticks, agreement with an independent plain-torch formula, the custom-loss wrapper."""

import math

import pytest
import tinker
import torch

from posttrain.preference.dpo import dpo_loss, dpo_loss_fn


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_loss_is_ln2_when_policy_equals_reference():
    loss, metrics = dpo_loss(_t(-5.0, -7.0), _t(-6.0, -2.0), _t(-5.0, -7.0), _t(-6.0, -2.0), beta=0.1)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-12)
    assert metrics["dpo_loss"] == pytest.approx(0.693147, abs=1e-6)
    assert metrics["accuracy"] == 0.5  # a tie is chance: neither a correct nor a wrong ranking
    assert metrics["margin"] == 0.0 and metrics["chosen_reward"] == 0.0 and metrics["rejected_reward"] == 0.0


def test_a_gap_within_float_noise_is_a_tie():
    """Policy = reference scored by two code paths differs by ~1e-5 per token: a tie (½), not a ranking."""
    _, metrics = dpo_loss(_t(-5.0 + 2e-4, -7.0), _t(-6.0, -2.0), _t(-5.0, -7.0), _t(-6.0, -2.0 + 3e-4), beta=0.1)
    assert metrics["accuracy"] == 0.5
    _, metrics = dpo_loss(_t(-5.0 - 2e-3), _t(-6.0), _t(-5.0), _t(-6.0), beta=0.1)
    assert metrics["accuracy"] == 0.0
    _, metrics = dpo_loss(_t(-5.0 + 2e-3), _t(-6.0), _t(-5.0), _t(-6.0), beta=0.1)
    assert metrics["accuracy"] == 1.0


def test_log_ratio_gap_two_gives_the_cookbook_value_and_gradient():
    chosen = _t(-3.0).requires_grad_(True)
    loss, metrics = dpo_loss(chosen, _t(-4.0), _t(-4.0), _t(-3.0), beta=0.1)  # (1) - (-1) = gap 2
    loss.backward()
    assert loss.item() == pytest.approx(0.598139, abs=1e-6)
    assert float(chosen.grad) == pytest.approx(-0.045017, abs=1e-6)
    assert metrics["accuracy"] == 1.0
    assert metrics["margin"] == pytest.approx(0.2)
    assert metrics["chosen_reward"] == pytest.approx(0.1) and metrics["rejected_reward"] == pytest.approx(-0.1)


def _independent_dpo(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta):
    """Sigmoid DPO written from the paper's formula: -log σ(β log π_c/π_ref_c − β log π_r/π_ref_r)."""
    logits = beta * (policy_chosen - ref_chosen) - beta * (policy_rejected - ref_rejected)
    return (torch.log1p(torch.exp(-logits))).mean()


def test_matches_an_independent_formula_with_gradients():
    generator = torch.Generator().manual_seed(3)
    values = [torch.randn(6, generator=generator, dtype=torch.float64) * 4 - 10 for _ in range(4)]
    ours_inputs = [v.clone().requires_grad_(True) for v in values[:2]]
    theirs_inputs = [v.clone().requires_grad_(True) for v in values[:2]]
    ours, _ = dpo_loss(*ours_inputs, values[2], values[3], beta=0.3)
    theirs = _independent_dpo(*theirs_inputs, values[2], values[3], 0.3)
    ours.backward()
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    for mine, reference in zip(ours_inputs, theirs_inputs):
        torch.testing.assert_close(mine.grad, reference.grad)


def _datum(weights: list[float]) -> tinker.Datum:
    n = len(weights)
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(list(range(n))),
        loss_fn_inputs={"target_tokens": list(range(1, n + 1)), "weights": tinker.TensorData(data=weights, dtype="float32", shape=[n])},
    )


def test_custom_loss_fn_sums_weighted_tokens_and_pairs_datums_in_order():
    data = [_datum([0, 1, 1]), _datum([0, 0, 1]), _datum([0, 1]), _datum([1, 1])]
    logprobs = [torch.tensor(v, requires_grad=True) for v in ([-9.0, -1.0, -2.0], [-9.0, -9.0, -4.0], [-5.0, -0.5], [-1.0, -1.0])]
    loss, metrics = dpo_loss_fn([-3.0, -0.5], [-4.0, -2.0], beta=0.5)(data, logprobs)
    # pair 0: chosen -3 (ref -3), rejected -4 (ref -4) -> margin 0; pair 1: chosen -0.5 (ref -0.5), rejected -2 (ref -2)
    assert loss.item() == pytest.approx(math.log(2))
    loss.backward()
    assert logprobs[0].grad.tolist() == pytest.approx([0.0, -0.125, -0.125])  # -β σ(0) / 2 pairs on weighted tokens
    assert logprobs[1].grad.tolist() == pytest.approx([0.0, 0.0, 0.125])
    assert metrics["accuracy"] == 0.5  # two ties


def test_custom_loss_fn_rejects_a_batch_that_is_not_pairs():
    with pytest.raises(ValueError, match="expects 4 datums"):
        dpo_loss_fn([0.0, 0.0], [0.0, 0.0], beta=0.1)([_datum([1.0])] * 3, [torch.zeros(1)] * 3)


def test_beta_must_be_positive():
    with pytest.raises(ValueError, match="beta must be positive"):
        dpo_loss(_t(0.0), _t(0.0), _t(0.0), _t(0.0), beta=0.0)
