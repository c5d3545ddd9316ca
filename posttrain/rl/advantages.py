"""Group-relative advantages (GRPO's) and constant-group removal (pass@k: ``posttrain.eval.pass_at_k``).

A = R − mean(R) within each group: the group's own mean is the baseline, so no value model is needed.
Dividing by the group's reward std is optional (``scale_by_std``; off by default as in the cookbook:
it over-weights groups whose rewards barely differ). A group whose rewards are all equal has zero
advantage everywhere: it costs a forward-backward and teaches nothing, so it may be removed.
"""

from __future__ import annotations

import logging

import numpy as np

from posttrain.rl.types import TrajectoryGroup

logger = logging.getLogger(__name__)

STD_EPSILON = 1e-6


def group_advantages(rewards_G: list[float] | np.ndarray, scale_by_std: bool = False) -> np.ndarray:
    rewards = np.asarray(rewards_G, dtype=np.float64)
    if rewards.size == 0:
        raise ValueError("group_advantages got an empty group; a group needs at least one trajectory")
    centred = rewards - rewards.mean()
    if scale_by_std:
        centred = centred / (rewards.std() + STD_EPSILON)
    return centred


def compute_advantages(groups_P: list[TrajectoryGroup], scale_by_std: bool = False) -> list[np.ndarray]:
    """One advantage per trajectory of each group (``advantages_P[p][g]``)."""
    return [group_advantages(group.total_rewards(), scale_by_std) for group in groups_P]


def is_constant(group: TrajectoryGroup) -> bool:
    rewards = group.total_rewards()
    return all(reward == rewards[0] for reward in rewards)


def remove_constant_reward_groups(groups_P: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
    """The groups whose rewards differ; when none do, the first group alone (so a step still runs)."""
    kept = [group for group in groups_P if not is_constant(group)]
    if kept:
        return kept
    if groups_P:
        logger.warning("every group of this batch has constant rewards: the step has no learning signal")
    return groups_P[:1]
