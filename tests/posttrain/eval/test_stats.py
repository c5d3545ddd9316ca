import math

import pytest

from posttrain.eval.stats import (
    Estimate,
    PairedDifference,
    binomial_estimate,
    mean_estimate,
    paired_difference,
)


def test_mean_estimate_is_the_mean_with_the_sample_standard_error():
    est = mean_estimate([1.0, 2.0, 3.0, 4.0])
    # s.d. with n-1: sqrt(((1.5² + .5²) * 2) / 3) = sqrt(5/3); s.e. = that / 2
    assert est == Estimate(2.5, math.sqrt(5 / 3) / 2, 4)


def test_binomial_matches_inspects_n_minus_one_and_the_mean_of_zero_one_scores():
    est = binomial_estimate(3, 10)
    assert est.value == 0.3
    assert est.stderr == pytest.approx(math.sqrt(0.3 * 0.7 / 9))
    assert mean_estimate([1] * 3 + [0] * 7).stderr == pytest.approx(est.stderr)


def test_one_item_has_no_standard_error_and_no_items_is_an_error():
    assert math.isnan(mean_estimate([0.5]).stderr)
    with pytest.raises(ValueError, match="no scores"):
        mean_estimate([])
    with pytest.raises(ValueError, match="NaN"):
        mean_estimate([1.0, float("nan")])
    with pytest.raises(ValueError, match="successes"):
        binomial_estimate(4, 3)


def test_paired_difference_uses_only_shared_items_and_cancels_item_difficulty():
    parent = {"a": 0.0, "b": 1.0, "c": 0.0, "d": 1.0, "only_parent": 1.0}
    child = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0, "only_child": 0.0}
    diff = paired_difference(child, parent)
    assert diff.n == 4 and diff.delta == 0.5
    assert diff.stderr == pytest.approx(math.sqrt((4 * 0.25) / 3) / 2)
    assert not diff.significant  # 0.5 < 2 × 0.289
    with pytest.raises(ValueError, match="share no scored item"):
        paired_difference({"x": 1.0}, {"y": 1.0})


def test_significance_needs_more_than_two_standard_errors():
    assert PairedDifference(0.1, 0.04, 100).significant
    assert not PairedDifference(0.08, 0.04, 100).significant
    assert not PairedDifference(0.5, float("nan"), 1).significant
    # every item moved by the same amount: zero spread, a certain change
    assert paired_difference({i: 1.0 for i in range(5)}, {i: 0.0 for i in range(5)}).significant


def test_as_dict_names_the_flat_metrics():
    assert Estimate(0.5, 0.1, 20).as_dict("accuracy") == {
        "accuracy": 0.5,
        "accuracy_stderr": 0.1,
        "accuracy_n": 20.0,
    }
