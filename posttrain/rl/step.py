"""The pieces one RL step is made of, shared by every driver (sync, streaming, async).

1. :func:`publish_sampler` — save the current weights for sampling, get a client on them and its path;
2. rollouts (``posttrain.rl.rollouts``) -> :class:`SampledGroup` s (a group plus the policy step that sampled it);
3. :func:`prepare_minibatch` — advantages, constant-group removal, datums, KL penalty;
4. :func:`submit_forward_backward` — one ``forward_backward`` per chunk of datums (gradients accumulate);
5. :class:`PendingRLStep` — awaits the calls, then reports metrics and one row per sample.
A driver decides only *when* each piece runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tinker

from posttrain.rl.advantages import compute_advantages, is_constant, remove_constant_reward_groups
from posttrain.rl.config import RLConfig
from posttrain.rl.data import DatumSource, assemble_datums, loss_inputs, mask_of
from posttrain.rl.kl import apply_kl_penalty, reference_logprobs, sampler_learner_stats
from posttrain.rl.types import Trajectory, TrajectoryGroup
from posttrain.training.recipe import StepOutcome

SAMPLER_NAME = "rl-step{step:06d}"


@dataclass(frozen=True)
class Sampler:
    client: tinker.SamplingClient
    path: str
    step: int  # the policy step whose weights it samples


def publish_sampler(training_client: tinker.TrainingClient, step: int, ttl_seconds: int | None = None) -> Sampler:
    """A sampler on the training client's weights *after* every op submitted so far (ops run in order)."""
    saved = training_client.save_weights_for_sampler(SAMPLER_NAME.format(step=step), ttl_seconds=ttl_seconds).result()
    return Sampler(training_client.create_sampling_client(saved.path).result(), saved.path, step)


@dataclass(frozen=True)
class SampledGroup:
    group: TrajectoryGroup
    label: str  # "<batch>.<index>": which dataset batch and position the group came from
    sampler_step: int
    sampler_path: str


@dataclass
class Minibatch:
    """The datums of some sampled groups, ready for forward_backward, and what is needed to report them."""

    sampled: list[SampledGroup]
    advantages: list[np.ndarray]  # per sampled group (constant groups included, at 0)
    trained: list[bool]  # per sampled group: did it contribute datums
    datums: list[tinker.Datum]
    sources: list[DatumSource]  # indices into ``sampled``
    metrics: dict[str, float] = field(default_factory=dict)


def prepare_minibatch(sampled: list[SampledGroup], config: RLConfig, reference: tinker.SamplingClient | None) -> Minibatch:
    groups = [item.group for item in sampled]
    advantages = compute_advantages(groups, config.scale_advantages_by_std)
    kept = remove_constant_reward_groups(groups) if config.remove_constant_reward_groups else groups
    kept_ids = {id(group) for group in kept}
    trained = [id(group) in kept_ids for group in groups]
    kept_indices = [index for index, keep in enumerate(trained) if keep]
    datums, kept_sources = assemble_datums([groups[i] for i in kept_indices], [advantages[i] for i in kept_indices])
    sources = [DatumSource(kept_indices[source.group], source.trajectory) for source in kept_sources]
    metrics: dict[str, float] = {}
    if config.kl_penalty_coef > 0 and datums:
        if reference is None:
            raise ValueError("kl_penalty_coef > 0 needs a reference sampler; the recipe creates it in start()")
        datums, metrics = apply_kl_penalty(datums, reference_logprobs(reference, datums), config.kl_penalty_coef, config.kl_discount)
    return Minibatch(sampled, advantages, trained, datums, sources, metrics)


def submit_forward_backward(
    training_client: tinker.TrainingClient, datums: list[tinker.Datum], config: RLConfig, num_chunks: int
) -> list[Any]:
    """``num_chunks`` forward_backward calls over consecutive slices of ``datums`` (empty slices skipped)."""
    sendable = [loss_inputs(datum, config.loss_fn) for datum in datums]
    bounds = np.linspace(0, len(sendable), num_chunks + 1).astype(int)
    loss_config = dict(config.loss_fn_config) or None
    return [
        training_client.forward_backward(sendable[start:end], config.loss_fn, loss_config)
        for start, end in zip(bounds[:-1], bounds[1:])
        if end > start
    ]


@dataclass
class StepCounters:
    """What a driver counts while it gathers a step's groups."""

    sampling_seconds: float = 0.0
    off_policy: bool = False  # the async driver: staleness and stale-group counts mean something
    dropped_stale: int = 0
    requeued_stale: int = 0


class PendingRLStep:
    """A submitted RL step: its minibatches' forward_backward futures and the optim_step future."""

    def __init__(
        self,
        step: int,
        minibatches: list[tuple[Minibatch, list[Any]]],
        optim_future: Any,
        counters: StepCounters,
        decode: Callable[[Sequence[int]], str],
        submitted_at: float,
    ):
        self.step = step
        self.minibatches = minibatches
        self.optim_future = optim_future
        self.counters = counters
        self.decode = decode
        self.submitted_at = submitted_at

    def result(self) -> StepOutcome:
        loss_sum = 0.0
        learner_stats: list[dict[str, float]] = []
        weights: list[float] = []
        for minibatch, futures in self.minibatches:
            outputs = [future.result() for future in futures]
            learner_logprobs = [np.asarray(o["logprobs"].to_numpy(), dtype=np.float64) for out in outputs for o in out.loss_fn_outputs]
            loss_sum += sum(float(out.metrics.get("loss:sum", 0.0)) for out in outputs)
            if minibatch.datums:
                learner_stats.append(sampler_learner_stats(minibatch.datums, learner_logprobs))
                weights.append(float(len(minibatch.datums)))
        self.optim_future.result()
        training_seconds = time.monotonic() - self.submitted_at
        metrics = step_metrics(self.step, self.minibatches, self.counters)
        metrics.update(_weighted_mean(learner_stats, weights))
        trained_tokens = sum(float(mask_of(datum).sum()) for minibatch, _ in self.minibatches for datum in minibatch.datums)
        metrics.update(
            {
                "loss:sum": loss_sum,
                "loss": loss_sum / max(trained_tokens, 1.0),  # per sampled token, comparable across batch sizes
                "num_tokens": float(sum(datum.model_input.length for minibatch, _ in self.minibatches for datum in minibatch.datums)),
                "time/training_s": training_seconds,
            }
        )
        rows = [row for minibatch, _ in self.minibatches for row in sample_rows(self.step, minibatch, self.decode)]
        return StepOutcome(metrics=metrics, rows=rows)


def step_metrics(step: int, minibatches: Sequence[tuple[Minibatch, list[Any]]], counters: StepCounters) -> dict[str, float]:
    sampled = [item for minibatch, _ in minibatches for item in minibatch.sampled]
    rewards = np.asarray([reward for item in sampled for reward in item.group.total_rewards()], dtype=np.float64)
    transitions = [t for item in sampled for traj in item.group.trajectories_G for t in traj.transitions]
    action_tokens = sum(len(t.action.tokens) for t in transitions)
    staleness = np.asarray([step - item.sampler_step for item in sampled], dtype=np.float64)
    metrics: dict[str, float] = {
        "reward/mean": float(rewards.mean()) if rewards.size else 0.0,
        "reward/std": float(rewards.std()) if rewards.size else 0.0,
        "frac_constant_reward_groups": float(np.mean([is_constant(item.group) for item in sampled])) if sampled else 0.0,
        "num_groups": float(len(sampled)),
        "num_groups_trained": float(sum(sum(m.trained) for m, _ in minibatches)),
        "num_datums": float(sum(len(m.datums) for m, _ in minibatches)),
        "num_action_tokens": float(action_tokens),
        "time/sampling_s": counters.sampling_seconds,
        "sampling/tokens_per_s": action_tokens / counters.sampling_seconds if counters.sampling_seconds > 0 else 0.0,
    }
    if counters.off_policy:  # on-policy drivers would log four series of zeros
        metrics |= {
            "staleness/mean": float(staleness.mean()) if staleness.size else 0.0,
            "staleness/max": float(staleness.max()) if staleness.size else 0.0,
            "async/dropped_stale_groups": float(counters.dropped_stale),
            "async/requeued_stale_groups": float(counters.requeued_stale),
        }
    for key in sorted({key for t in transitions for key in t.metrics}):
        values = [t.metrics[key] for t in transitions if key in t.metrics]
        metrics[f"env/{key}"] = float(np.mean(values))
    group_metrics = [m for item in sampled for m in item.group.metrics_G]  # per trajectory, from compute_group_rewards
    for key in sorted({key for m in group_metrics for key in m}):
        metrics[f"env/{key}"] = float(np.mean([m[key] for m in group_metrics if key in m]))
    if "env/correct" in metrics:
        metrics["accuracy"] = metrics["env/correct"]
    elif "env/solved" in metrics:
        metrics["accuracy"] = float(np.mean([max(t.metrics.get("solved", 0.0) for t in traj.transitions) for item in sampled for traj in item.group.trajectories_G]))
    kl_values = [m.metrics["kl_policy_reference"] for m, _ in minibatches if "kl_policy_reference" in m.metrics]
    if kl_values:
        metrics["kl_policy_reference"] = float(np.mean(kl_values))
    return metrics


def sample_rows(step: int, minibatch: Minibatch, decode: Callable[[Sequence[int]], str]) -> list[dict[str, Any]]:
    rows = []
    for index, item in enumerate(minibatch.sampled):
        rewards = item.group.total_rewards()
        logs_G = item.group.logs_G or [{} for _ in item.group.trajectories_G]
        for trajectory_index, trajectory in enumerate(item.group.trajectories_G):
            tokens = [token for t in trajectory.transitions for token in t.action.tokens]
            logprobs = [value for t in trajectory.transitions for value in t.action.logprobs]
            rows.append(
                {
                    "step": step,
                    "group": item.label,
                    "sample": trajectory_index,
                    "tags": list(item.group.tags),
                    "prompt": decode(list(trajectory.transitions[0].observation.to_ints())),
                    "prompt_tokens": list(trajectory.transitions[0].observation.to_ints()),
                    "completion": decode(tokens),
                    "completion_tokens": tokens,
                    "sampler_logprobs": logprobs,
                    "reward": float(rewards[trajectory_index]),
                    "advantage": float(minibatch.advantages[index][trajectory_index]),
                    "trained": minibatch.trained[index],
                    "num_turns": len(trajectory.transitions),
                    "correct": trajectory_correct(trajectory, item.group.metrics_G[trajectory_index]),
                    "sampler_step": item.sampler_step,
                    "sampler_path": item.sampler_path,
                    **logs_G[trajectory_index],  # env text, e.g. sandbox_status / test_output for code
                }
            )
    return rows


def trajectory_correct(trajectory: Trajectory, group_metrics: dict[str, float] | None = None) -> float | None:
    """1.0 when any turn, or the group's grading (code), was graded correct (``correct``, or ``solved`` for
    games); None for envs that grade neither."""
    graded = [t.metrics for t in trajectory.transitions] + [group_metrics or {}]
    grades = [metrics[key] for metrics in graded for key in ("correct", "solved") if key in metrics]
    return float(max(grades)) if grades else None


def _weighted_mean(stats: list[dict[str, float]], weights: list[float]) -> dict[str, float]:
    keys = sorted({key for entry in stats for key in entry})
    total = sum(weights)
    return {key: sum(entry.get(key, 0.0) * w for entry, w in zip(stats, weights)) / total for key in keys} if total else {}
