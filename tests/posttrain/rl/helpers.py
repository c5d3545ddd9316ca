"""Trajectories built by hand, for tests of the pure RL functions."""

from __future__ import annotations

import tinker

from posttrain.completers import TokensWithLogprobs
from posttrain.rl.types import Trajectory, TrajectoryGroup, Transition


def turn(observation: list[int], action: list[int], logprobs: list[float] | None = None, reward: float = 0.0, done: bool = True) -> Transition:
    logprobs = logprobs if logprobs is not None else [-0.5] * len(action)
    return Transition(tinker.ModelInput.from_ints(observation), TokensWithLogprobs(action, logprobs, "stop"), reward, done)


def group(rewards: list[float]) -> TrajectoryGroup:
    trajectories = [Trajectory([turn([1, 2], [3], reward=reward)]) for reward in rewards]
    return TrajectoryGroup(trajectories, [0.0] * len(rewards), [{} for _ in rewards])
