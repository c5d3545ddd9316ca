import math

import pytest

from posttrain.schedules import learning_rate_at, lr_multiplier


@pytest.mark.parametrize("step", [0, 1, 5, 9])
def test_multipliers_without_warmup_match_cookbook_formulas(step):
    total = 10
    assert lr_multiplier("linear", step, total) == pytest.approx(1 - step / total)
    assert lr_multiplier("cosine", step, total) == pytest.approx(0.5 * (1 + math.cos(math.pi * step / total)))
    assert lr_multiplier("constant", step, total) == 1.0


def test_linear_and_cosine_decay_monotonically_to_near_zero():
    linear = [lr_multiplier("linear", s, 100) for s in range(100)]
    cosine = [lr_multiplier("cosine", s, 100) for s in range(100)]
    assert all(a > b for a, b in zip(linear, linear[1:]))
    assert all(a > b for a, b in zip(cosine, cosine[1:]))
    assert linear[0] == cosine[0] == 1.0
    assert linear[-1] == pytest.approx(0.01)
    assert cosine[50] == pytest.approx(0.5)


def test_warmup_ramps_from_first_step_then_decays_over_the_rest():
    total, warmup = 12, 4
    ramp = [lr_multiplier("linear", s, total, warmup) for s in range(warmup)]
    assert ramp == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr_multiplier("linear", warmup, total, warmup) == 1.0
    assert lr_multiplier("linear", warmup + 4, total, warmup) == pytest.approx(0.5)
    assert lr_multiplier("cosine", warmup + 4, total, warmup) == pytest.approx(0.5)
    assert lr_multiplier("constant", 1, total, warmup) == pytest.approx(0.5)


def test_learning_rate_scales_the_base_rate():
    assert learning_rate_at(2e-4, "linear", 5, 10) == pytest.approx(1e-4)


@pytest.mark.parametrize(
    "args, message",
    [
        (("triangle", 0, 10), "unknown lr_schedule"),
        (("linear", 0, 0), "total_steps"),
        (("linear", 0, 10, 10), "warmup_steps"),
        (("linear", -1, 10), "step must be"),
    ],
)
def test_bad_arguments_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        lr_multiplier(*args)
