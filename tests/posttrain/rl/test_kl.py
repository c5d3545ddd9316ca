import numpy as np
import pytest

from posttrain.rl.data import trajectory_to_datums
from posttrain.rl.kl import apply_kl_penalty, discounted_future_sum, sampler_learner_stats
from posttrain.rl.types import Trajectory
from tests.posttrain.rl.helpers import turn


def two_datums():
    a = trajectory_to_datums(Trajectory([turn([1, 2], [3, 4], logprobs=[-1.0, -2.0])]), advantage=1.0)[0]
    b = trajectory_to_datums(Trajectory([turn([1, 2], [5], logprobs=[-0.5])]), advantage=-1.0)[0]
    return [a, b]


def test_kl_penalty_adds_coef_mask_times_mean_minus_d_to_the_advantages():
    datums = two_datums()
    # target positions: a = [2, 3, 4] (mask 0, 1, 1); b = [2, 5] (mask 0, 1)
    reference = [np.array([-9.0, -1.5, -1.0]), np.array([-9.0, -1.5])]
    penalised, metrics = apply_kl_penalty(datums, reference, coef=0.1)
    d_a = [0.0, -1.0 - -1.5, -2.0 - -1.0]  # [0, 0.5, -1.0]
    d_b = [0.0, -0.5 - -1.5]  # [0, 1.0]
    mean_d = (0.5 - 1.0 + 1.0) / 3
    assert metrics["kl_policy_reference"] == pytest.approx(mean_d)
    expected_a = [0.0, 1.0 + 0.1 * (mean_d - d_a[1]), 1.0 + 0.1 * (mean_d - d_a[2])]
    expected_b = [0.0, -1.0 + 0.1 * (mean_d - d_b[1])]
    assert penalised[0].loss_fn_inputs["advantages"].to_numpy() == pytest.approx(expected_a, abs=1e-6)
    assert penalised[1].loss_fn_inputs["advantages"].to_numpy() == pytest.approx(expected_b, abs=1e-6)


def test_discounted_penalty_collects_later_tokens_and_bad_settings_are_refused():
    assert discounted_future_sum(np.array([1.0, 2.0, 4.0]), 0.5).tolist() == [1.0 + 1.0 + 1.0, 2.0 + 2.0, 4.0]
    datums = two_datums()
    reference = [np.zeros(3), np.zeros(2)]
    with pytest.raises(ValueError, match="kl_discount"):
        apply_kl_penalty(datums, reference, coef=0.1, discount=1.0)
    with pytest.raises(ValueError, match="kl_penalty_coef"):
        apply_kl_penalty(datums, reference, coef=-1.0)


def test_sampler_learner_stats_average_over_sampled_tokens_only():
    datums = two_datums()
    learner = [np.array([5.0, -1.5, -2.0]), np.array([5.0, -0.25])]  # observation positions must not count
    stats = sampler_learner_stats(datums, learner)
    diffs = [0.5, 0.0, -0.25]
    assert stats["kl_sample_train_k1"] == pytest.approx(np.mean(diffs))
    assert stats["kl_sample_train_k2"] == pytest.approx(np.mean([0.5 * d * d for d in diffs]))
    assert stats["entropy"] == pytest.approx(np.mean([1.0, 2.0, 0.5]))
