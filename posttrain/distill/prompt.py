"""Prompt (off-policy) distillation: a teacher *with* a system prompt answers prompts; a student learns
the answers *without* it.

1. :func:`teacher_responses` — the teacher (any sampling client: a checkpoint or a base model) answers
   each problem's question under ``system_prompt``, greedily (``temperature`` 0) or sampled; each answer
   becomes a chat-schema row ``[user: question, assistant: answer]`` — the system prompt left out, so SFT
   on these rows bakes its effect into the weights. ``split`` is the problem's, so held-out prompts stay
   held out.
2. SFT of the student on the train rows (``posttrain.supervised``).
   :class:`PromptDistillConfig` / :class:`PromptDistillRecipe` are SFT's, named for lineage.
3. :class:`AgreementEvaluator` — on held-out prompts, the fraction where the student's greedy answer
   (no system prompt) grades the same as the teacher's recorded one: ``agreement``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import tinker

from posttrain.completers import ChatRenderer, MessageCompleter, SamplingSettings, TokenCompleter
from posttrain.datasets.problems import RLProblem
from posttrain.datasets.schemas import HELDOUT_SPLIT
from posttrain.eval.accuracy import TaskProblem, evaluate_accuracy, problem_keys
from posttrain.eval.answers import extract_answer
from posttrain.eval.base import EvalTarget
from posttrain.eval.math_answers import same_value
from posttrain.supervised.config import SupervisedConfig
from posttrain.supervised.data import LossReduction
from posttrain.supervised.recipe import SupervisedRecipe
from posttrain.training.config import TrainingConfig, documented


@dataclass(frozen=True)
class TeacherSampling:
    system_prompt: str
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy (top_k=1)
    seed: int = 0

    def settings(self) -> SamplingSettings:
        if self.max_tokens < 1 or self.temperature < 0:
            raise ValueError(f"teacher sampling needs max_tokens >= 1 and temperature >= 0, got {self.max_tokens}, {self.temperature}")
        if self.temperature == 0:
            return SamplingSettings(max_tokens=self.max_tokens, temperature=1.0, top_k=1)
        return SamplingSettings(max_tokens=self.max_tokens, temperature=self.temperature)


def teacher_responses(
    sampling_client: tinker.SamplingClient, renderer: ChatRenderer, problems: Sequence[RLProblem], sampling: TeacherSampling, source: str
) -> list[dict[str, Any]]:
    """One chat row per problem: the question and the teacher's answer, without the system prompt.

    Every request is submitted before any is awaited; each is seeded by (seed, position) so a re-run
    with the same teacher answers the same.
    """
    if not problems:
        raise ValueError("teacher_responses got no prompts: the prompt table (split filter) is empty")
    completer = MessageCompleter(TokenCompleter(sampling_client, sampling.settings()), renderer)
    system = [{"role": "system", "content": sampling.system_prompt}] if sampling.system_prompt else []
    pending = [
        completer.submit(system + [{"role": "user", "content": problem.question}], seed=sampling.seed + index)
        for index, problem in enumerate(problems)
    ]
    rows = []
    for problem, request in zip(problems, pending, strict=True):
        (completion,) = request.result()
        rows.append(
            {
                "row_id": problem.row_id,
                "source": source,
                "split": problem.split,
                "messages": [{"role": "user", "content": problem.question}, {"role": "assistant", "content": completion.text}],
            }
        )
    return rows


def agreement_problems(rows: Sequence[dict[str, Any]], limit: int = 0, split: str = HELDOUT_SPLIT) -> list[TaskProblem]:
    """The ``split`` teacher rows as problems whose gold answer is the teacher's answer text."""
    problems = [
        TaskProblem(question=row["messages"][0]["content"], answer=row["messages"][-1]["content"], row_id=row["row_id"])
        for row in rows
        if row["split"] == split
    ]
    return problems[:limit] if limit else problems


def same_answer(student_extracted: str | None, problem: TaskProblem) -> float:
    """1.0 when the student's extracted answer matches the teacher's (or neither states one)."""
    teacher = extract_answer(problem.answer)
    if teacher is None:
        return 1.0 if student_extracted is None else 0.0
    return 1.0 if same_value(student_extracted, teacher) else 0.0


class AgreementEvaluator:
    """``agreement``: held-out prompts where the target's greedy answer (no system prompt) matches the teacher's."""

    def __init__(self, renderer: ChatRenderer, problems: Sequence[TaskProblem], max_tokens: int = 64, seed: int = 0):
        if not problems:
            raise ValueError("AgreementEvaluator got no held-out teacher answers: materialize teacher_responses with held-out prompts")
        self.renderer, self.problems, self.max_tokens, self.seed = renderer, list(problems), max_tokens, seed

    def _evaluate(self, target: EvalTarget):
        return evaluate_accuracy(target, self.renderer, self.problems, max_tokens=self.max_tokens, seed=self.seed, grade=same_answer)

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        result = self._evaluate(target)
        return {"agreement": result.accuracy, "agreement_prompts": float(result.num_samples)}

    def score_items(self, target: EvalTarget) -> dict[str, dict[str, float]]:
        """Per held-out prompt (keyed by its hash): 1 when the greedy answer matches the teacher's."""
        rows = self._evaluate(target).rows
        return {"agreement": {key: float(row.correct) for key, row in zip(problem_keys(self.problems), rows)}}


@dataclass
class PromptDistillConfig:
    """SFT of the student on the teacher's train-split answers (rendered without the system prompt)."""

    training: TrainingConfig = field(default_factory=TrainingConfig)
    renderer: str = documented("auto", "Chat renderer the student is trained and evaluated with; auto = the base model's recommended one.")
    max_length: int | None = documented(512, "Cut rendered conversations at this many tokens (None = no cap).")
    batch_size: int = documented(8, "Teacher answers per optimizer step.")
    num_epochs: int = documented(1, "Passes over the teacher's train-split answers.")
    shuffle: bool = documented(True, "Shuffle inside each epoch (seeded by (seed, epoch)).")
    loss_reduction: LossReduction = documented("mean", "mean (each answer's weights sum to 1) | sum | token_mean.")

    def __post_init__(self) -> None:
        if isinstance(self.training, dict):
            self.training = TrainingConfig(**self.training)

    def supervised(self) -> SupervisedConfig:
        """The SFT settings (validated: a bad batch size or reduction raises, naming the field)."""
        return SupervisedConfig(
            training=self.training, batch_size=self.batch_size, num_epochs=self.num_epochs,
            shuffle=self.shuffle, loss_reduction=self.loss_reduction,
        )


class PromptDistillRecipe(SupervisedRecipe):
    """SFT's recipe under its own name, so checkpoints and run identity say what trained them."""

    name = "prompt_distill"
