"""Held-out evaluation of an RL env: the env's own reward, greedy accuracy and pass@k, multi-turn included.

Each held-out row is played by exactly the env that trains on it (``posttrain.rl.envs.instances``):
once greedily (``top_k=1``: reproducible ``reward`` and ``accuracy``), and ``num_samples`` times at
temperature 1 for ``pass@1`` (c/n) and the unbiased ``pass@k``. A play counts as correct when its env
says so (``correct`` in the step or group metrics: the right answer, the secret found). Scores are per
row, keyed by the row's prompt and gold answer (guess-the-number games share one prompt), so a report can
pair a checkpoint with its parent item by item.
"""

from __future__ import annotations

from collections.abc import Sequence

from posttrain.completers import ChatRenderer, SamplingSettings, TokenCompleter
from posttrain.datasets.problems import RLProblem
from posttrain.eval.base import EvalTarget
from posttrain.eval.items import ItemScores, mean_metrics, unique_keys
from posttrain.eval.pass_at_k import pass_at_k
from posttrain.rl.envs.instances import group_builder
from posttrain.rl.envs.problem_env import DEFAULT_FORMAT_COEF
from posttrain.rl.rollouts import derive_seed, rollout_groups
from posttrain.rl.types import TrajectoryGroup


def _correct(group: TrajectoryGroup) -> list[float]:
    found = []
    for trajectory, metrics in zip(group.trajectories_G, group.metrics_G):
        step_metrics = trajectory.transitions[-1].metrics if trajectory.transitions else {}
        found.append(float(metrics.get("correct", step_metrics.get("correct", 0.0))))
    return found


class EnvEvaluator:
    """``reward``, ``accuracy`` (greedy) and, with ``k`` > 0, ``pass@1`` / ``pass@k`` over held-out env rows."""

    def __init__(
        self,
        renderer: ChatRenderer,
        problems: Sequence[RLProblem],
        *,
        k: int = 4,
        num_samples: int | None = None,
        max_tokens: int = 32,
        format_coef: float = DEFAULT_FORMAT_COEF,
        seed: int = 0,
    ):
        self.num_samples = k if num_samples is None else num_samples
        if not problems:
            raise ValueError("EnvEvaluator got no held-out rows: materialize rl_problems with heldout_fraction > 0")
        if k < 0 or (k > 0 and self.num_samples < k):
            raise ValueError(f"EnvEvaluator: need 0 <= k <= num_samples, got k={k}, num_samples={self.num_samples}")
        self.renderer, self.problems, self.k = renderer, list(problems), k
        self.max_tokens, self.format_coef, self.seed = max_tokens, format_coef, seed
        self.keys = unique_keys(f"{p.question}\n{p.answer}" for p in self.problems)

    def _play(self, target: EvalTarget, group_size: int, settings: SamplingSettings) -> list[TrajectoryGroup]:
        builders = [group_builder(p, self.renderer, group_size, format_coef=self.format_coef) for p in self.problems]
        seeds = [derive_seed(self.seed, index) for index in range(len(builders))]
        return rollout_groups(builders, TokenCompleter(target.sampling_client(), settings), seeds)

    def score_items(self, target: EvalTarget) -> ItemScores:
        greedy = self._play(target, 1, SamplingSettings(max_tokens=self.max_tokens, top_k=1))
        scores: ItemScores = {
            "reward": {key: group.total_rewards()[0] for key, group in zip(self.keys, greedy)},
            "accuracy": {key: _correct(group)[0] for key, group in zip(self.keys, greedy)},
        }
        if self.k > 0:
            sampled = self._play(target, self.num_samples, SamplingSettings(max_tokens=self.max_tokens, temperature=1.0))
            correct_P = [int(sum(_correct(group))) for group in sampled]
            scores["pass@1"] = {key: c / self.num_samples for key, c in zip(self.keys, correct_P)}
            if self.k > 1:
                scores[f"pass@{self.k}"] = {key: pass_at_k(self.num_samples, c, self.k) for key, c in zip(self.keys, correct_P)}
        return scores

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        return mean_metrics(self.score_items(target))
