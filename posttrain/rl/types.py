"""The RL vocabulary (tinker-cookbook's names and meanings), one page.

- :class:`Env` — one episode: ``initial_observation()`` gives the first prompt and its stop condition;
  ``step(action_tokens)`` grades an action and returns a :class:`StepResult` (reward, done, the next
  prompt when the episode goes on). Envs are single-use and synchronous: the rollout code, not the env,
  owns concurrency.
- :class:`EnvGroupBuilder` — makes the G envs of one *group* (usually G copies of one problem): group
  advantages are centred within it. ``compute_group_rewards`` adds rewards that need the whole group
  (pairwise judges, or grading all G programs in a sandbox pool at once); ``trajectory_logs`` gives
  per-trajectory text for the rollout rows (e.g. a sandbox status and test output); ``logging_tags``
  name the group in metrics.
- :class:`RLDataset` — ``get_batch(index)`` returns the builders of one training step, a pure function of
  the index (and the dataset's seed), which is what makes resume after a crash exact.
- :class:`Transition` / :class:`Trajectory` / :class:`TrajectoryGroup` — what a rollout records.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import tinker

from posttrain.completers import StopCondition, TokensWithLogprobs

Action = list[int]
Observation = tinker.ModelInput
Metrics = dict[str, float]
Logs = dict[str, str]


@dataclass(frozen=True)
class StepResult:
    reward: float
    episode_done: bool
    next_observation: Observation | None = None  # required while the episode goes on
    next_stop: StopCondition | None = None
    metrics: Metrics = field(default_factory=dict)


class Env(ABC):
    @abstractmethod
    def initial_observation(self) -> tuple[Observation, StopCondition]: ...

    @abstractmethod
    def step(self, action: Action) -> StepResult: ...


class EnvGroupBuilder(ABC):
    @abstractmethod
    def make_envs(self) -> Sequence[Env]: ...

    def compute_group_rewards(self, trajectories: Sequence[Trajectory], envs: Sequence[Env]) -> list[tuple[float, Metrics]]:
        """Final rewards given once the whole group has finished (default: none)."""
        return [(0.0, {}) for _ in trajectories]

    def trajectory_logs(self, envs: Sequence[Env]) -> list[Logs]:
        """Text per trajectory for the rollout rows, read after ``compute_group_rewards`` (default: none)."""
        return [{} for _ in envs]

    def logging_tags(self) -> list[str]:
        return []


class RLDataset(ABC):
    @abstractmethod
    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def identity(self) -> dict[str, object]:
        """JSON values that fix what ``get_batch(k)`` returns (a resume with other values is refused)."""
        return {"dataset": type(self).__name__, "num_batches": len(self)}


@dataclass(frozen=True)
class Transition:
    observation: Observation
    action: TokensWithLogprobs
    reward: float
    episode_done: bool
    metrics: Metrics = field(default_factory=dict)


@dataclass(frozen=True)
class Trajectory:
    transitions: list[Transition]
    final_observation: Observation | None = None

    @property
    def step_reward(self) -> float:
        return sum(transition.reward for transition in self.transitions)

    @property
    def num_action_tokens(self) -> int:
        return sum(len(transition.action.tokens) for transition in self.transitions)


@dataclass(frozen=True)
class TrajectoryGroup:
    """The G trajectories of one group, with the final (group-level) reward, metrics and logs of each."""

    trajectories_G: list[Trajectory]
    final_rewards_G: list[float]
    metrics_G: list[Metrics]
    tags: tuple[str, ...] = ()
    logs_G: list[Logs] = field(default_factory=list)  # empty, or one dict per trajectory

    def __post_init__(self) -> None:
        if not len(self.trajectories_G) == len(self.final_rewards_G) == len(self.metrics_G):
            raise ValueError(
                f"TrajectoryGroup: {len(self.trajectories_G)} trajectories, {len(self.final_rewards_G)} final rewards, "
                f"{len(self.metrics_G)} metric dicts; give one of each per trajectory"
            )
        if self.logs_G and len(self.logs_G) != len(self.trajectories_G):
            raise ValueError(f"TrajectoryGroup: {len(self.trajectories_G)} trajectories but {len(self.logs_G)} log dicts")

    def total_rewards(self) -> list[float]:
        """Per trajectory: the sum of its step rewards plus its final reward."""
        return [traj.step_reward + final for traj, final in zip(self.trajectories_G, self.final_rewards_G)]
