import numpy as np
import pytest

from posttrain.rl.advantages import compute_advantages, group_advantages, is_constant, remove_constant_reward_groups
from posttrain.rl.types import TrajectoryGroup
from tests.posttrain.rl.helpers import group


def test_advantages_are_rewards_minus_the_group_mean_and_optionally_scaled_by_std():
    assert group_advantages([1.0, 0.0, 0.0, 1.0]).tolist() == [0.5, -0.5, -0.5, 0.5]
    scaled = group_advantages([1.0, 0.0, 0.0, 1.0], scale_by_std=True)
    assert scaled == pytest.approx([1.0, -1.0, -1.0, 1.0], rel=1e-5)
    assert group_advantages([3.0, 3.0], scale_by_std=True).tolist() == [0.0, 0.0]  # no division by zero


def test_total_rewards_add_step_and_final_rewards_and_feed_the_advantages():
    base = group([1.0, 0.0])
    with_final = TrajectoryGroup(base.trajectories_G, [0.5, 0.0], [{}, {}])
    assert with_final.total_rewards() == [1.5, 0.0]
    [advantages] = compute_advantages([with_final])
    assert advantages.tolist() == [0.75, -0.75]


def test_constant_groups_are_removed_but_one_is_kept_when_all_are_constant():
    varied, flat_one, flat_zero = group([1.0, 0.0]), group([1.0, 1.0]), group([0.0, 0.0])
    assert is_constant(flat_one) and not is_constant(varied)
    assert remove_constant_reward_groups([flat_one, varied, flat_zero]) == [varied]
    assert remove_constant_reward_groups([flat_one, flat_zero]) == [flat_one]
    assert remove_constant_reward_groups([]) == []


def test_an_empty_group_is_refused():
    with pytest.raises(ValueError, match="empty group"):
        group_advantages(np.asarray([]))
