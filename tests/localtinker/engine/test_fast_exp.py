"""``fast_exp.exp_``: exp through exp2 for float32, within the product's rounding of the true value."""

from __future__ import annotations

import torch

from localtinker.engine.fast_exp import exp_


def test_float32_values_are_within_a_few_parts_per_million_of_exp() -> None:
    x = torch.linspace(-87.0, 0.0, 100_001)
    reference = torch.exp(x.double())
    result = exp_(x.clone())
    relative = ((result.double() - reference).abs() / reference).max().item()
    assert relative < 4e-6  # |x| · 2^-24 · log2(e) at x = -87, plus exp2's own rounding
    near_zero = torch.linspace(-4.0, 0.0, 10_001)  # where the terms that carry a softmax's sum lie
    close = ((exp_(near_zero.clone()).double() - torch.exp(near_zero.double())).abs() / torch.exp(near_zero.double())).max()
    assert close.item() < 5e-7


def test_in_place_with_exact_ends_and_float64_unchanged() -> None:
    values = torch.tensor([0.0, float("-inf"), -1.0])
    assert exp_(values) is values
    assert values[0].item() == 1.0 and values[1].item() == 0.0  # the row maximum weighs exactly 1; masked, 0
    doubles = torch.linspace(-50.0, 0.0, 1001, dtype=torch.float64)
    assert torch.equal(exp_(doubles.clone()), torch.exp(doubles))
