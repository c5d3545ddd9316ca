"""On-policy distillation as a training-core recipe: the student samples, its teachers score every token.

    recipe = DistillRecipe(config, dataset, routing, student_tokenizer)
    train(config.training, recipe, service_client)

Step ``s`` (the pieces are RL's, ``posttrain.rl.step``): publish a sampler on the student's current
weights; roll out batch ``s`` (seeded as RL's sync driver, so a resumed run samples the same tokens);
give each trajectory ``reward_coef`` × its group's reward advantage (0 by default); add the per-token
reverse-KL advantages against the teacher of the group's dataset (``posttrain.distill.advantages``);
``importance_sampling`` forward_backward and one optim_step. The core owns checkpoints, resume, LR.

Metrics: RL's (reward, accuracy, entropy, KL(sampler‖learner) ...) plus ``teacher_kl`` (mean reverse KL
per sampled token) and ``teacher_kl/<dataset>``. Rows: RL's per-sample rows plus dataset, teacher and
the sample's ``teacher_kl``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import tinker

from posttrain.completers import SamplingSettings, TokenCompleter
from posttrain.datasets.tokens import tokenizer_identity
from posttrain.distill.advantages import TeacherScores, add_teacher_advantages
from posttrain.distill.config import DistillConfig
from posttrain.distill.teachers import TeacherRouting, check_teacher_tokenizers, dataset_of, teacher_logprobs
from posttrain.rl.advantages import compute_advantages
from posttrain.rl.data import assemble_datums
from posttrain.rl.rollouts import derive_seed, rollout_groups
from posttrain.rl.step import Minibatch, PendingRLStep, SampledGroup, StepCounters, publish_sampler, submit_forward_backward
from posttrain.rl.types import RLDataset
from posttrain.training.recipe import StepOutcome


class PendingDistillStep:
    """RL's pending step, with the teacher metrics and per-sample teacher columns added to its outcome."""

    def __init__(self, rl_step: PendingRLStep, metrics: dict[str, float], sample_columns: dict[tuple[str, int], dict[str, Any]]):
        self.rl_step, self.metrics, self.sample_columns = rl_step, metrics, sample_columns

    def result(self) -> StepOutcome:
        outcome = self.rl_step.result()
        rows = [{**row, **self.sample_columns.get((row["group"], row["sample"]), {})} for row in outcome.rows]
        return StepOutcome({**outcome.metrics, **self.metrics}, rows)


class DistillRecipe:
    name = "distill"

    def __init__(self, config: DistillConfig, dataset: RLDataset, routing: TeacherRouting, student_tokenizer: Any):
        config.validate()
        if len(dataset) == 0:
            raise ValueError("DistillRecipe got an empty dataset: it has no prompts to sample")
        check_teacher_tokenizers(tokenizer_identity(student_tokenizer, config.training.base_model), routing)
        self.config, self.dataset, self.routing, self.tokenizer = config, dataset, routing, student_tokenizer
        self.rl_config = config.rl_config()
        self.settings = SamplingSettings(max_tokens=config.max_tokens, temperature=config.temperature)
        self._clients: dict[str, tinker.SamplingClient] = {}

    def num_steps(self) -> int:
        return len(self.dataset)

    def identity(self) -> dict[str, Any]:
        return {"distill": self.config.identity(), "dataset": self.dataset.identity(), "teachers": self.routing.describe()}

    def start(self, training_client: tinker.TrainingClient, service_client: tinker.ServiceClient, start_step: int) -> None:
        self._clients = {key: teacher.create_sampling_client(service_client) for key, teacher in self.routing.distinct().items()}

    def close(self) -> None:
        self._clients = {}

    def submit_step(self, step: int, training_client: tinker.TrainingClient, adam: tinker.AdamParams) -> PendingDistillStep:
        if not self._clients:
            raise RuntimeError("DistillRecipe.submit_step before start(): start() creates the teachers' sampling clients")
        sampler = publish_sampler(training_client, step, self.config.training.checkpoint_ttl_seconds)
        builders = self.dataset.get_batch(step)
        started = time.monotonic()
        seeds = [derive_seed(self.config.training.seed, step, index) for index in range(len(builders))]
        groups = rollout_groups(builders, TokenCompleter(sampler.client, self.settings), seeds)
        counters = StepCounters(sampling_seconds=time.monotonic() - started)
        sampled = [SampledGroup(group, f"{step}.{index}", sampler.step, sampler.path) for index, group in enumerate(groups)]

        advantages = [self.config.reward_coef * a for a in compute_advantages(groups)]
        datums, sources = assemble_datums(groups, advantages)
        datasets = [dataset_of(builder, self.config.env) for builder in builders]
        teachers_D = [self.routing.teacher_for(datasets[source.group]) for source in sources]
        lp_teacher = teacher_logprobs([self._clients[teacher.key()] for teacher in teachers_D], datums)
        datums, scores = add_teacher_advantages(datums, lp_teacher, self.config.kl_coef, self.config.kl_discount)

        minibatch = Minibatch(sampled, advantages, [True] * len(sampled), datums, sources)
        futures = submit_forward_backward(training_client, datums, self.rl_config, self.config.num_substeps)
        rl_step = PendingRLStep(step, [(minibatch, futures)], training_client.optim_step(adam), counters, self._decode, started)
        by_sample: dict[tuple[int, int], list[int]] = {}
        for index, source in enumerate(sources):  # a multi-turn trajectory may make several datums
            by_sample.setdefault((source.group, source.trajectory), []).append(index)
        columns = {
            (sampled[group].label, trajectory): {
                "dataset": datasets[group],
                "teacher": teachers_D[indices[0]].name,
                "teacher_kl": scores.mean_kl(indices),
            }
            for (group, trajectory), indices in by_sample.items()
        }
        return PendingDistillStep(rl_step, teacher_metrics(scores, [datasets[s.group] for s in sources]), columns)

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))


def teacher_metrics(scores: TeacherScores, datasets_D: list[str]) -> dict[str, float]:
    """``teacher_kl`` over every sampled token of the step, and per dataset when there are several."""
    metrics = {"teacher_kl": scores.mean_kl()}
    names = sorted(set(datasets_D))
    if len(names) > 1:
        for name in names:
            metrics[f"teacher_kl/{name}"] = scores.mean_kl([i for i, d in enumerate(datasets_D) if d == name])
    return metrics


__all__ = ["DistillRecipe", "PendingDistillStep", "teacher_metrics"]
