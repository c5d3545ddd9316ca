"""Held-out evaluation of a distilled student: its reverse KL to its teachers, and the teachers' own accuracy.

- :class:`TeacherKLEvaluator` — ``teacher_kl``: the target answers each held-out prompt (temperature 1,
  seeded), and the prompt's teacher (routed by dataset, as in training) scores the answer's tokens;
  the mean over sampled tokens of lp_target − lp_teacher estimates KL(target‖teacher) per token.
- :class:`TeacherAccuracyEvaluator` — ``teacher_accuracy``: the teachers' greedy accuracy on the same
  held-out problems (each problem answered by its own teacher), computed once and repeated for every
  target, so a report's columns read "student vs teacher".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import tinker

from posttrain.completers import ChatRenderer, SamplingSettings, TokenCompleter
from posttrain.distill.teachers import TeacherRouting
from posttrain.eval.accuracy import TaskProblem, evaluate_accuracy
from posttrain.eval.base import EvalTarget

ServiceFactory = Callable[[], tinker.ServiceClient]


@dataclass(frozen=True)
class RoutedProblem:
    problem: TaskProblem
    dataset: str


def _messages(problem: TaskProblem) -> list[dict[str, str]]:
    system = [{"role": "system", "content": problem.system}] if problem.system else []
    return system + [{"role": "user", "content": problem.question}]


class _TeacherClients:
    """One sampling client per distinct teacher, created on first use from the service factory."""

    def __init__(self, routing: TeacherRouting, service: ServiceFactory):
        self.routing, self.service = routing, service
        self._clients: dict[str, tinker.SamplingClient] = {}

    def for_dataset(self, dataset: str) -> tinker.SamplingClient:
        teacher = self.routing.teacher_for(dataset)
        if teacher.key() not in self._clients:
            self._clients[teacher.key()] = teacher.create_sampling_client(self.service())
        return self._clients[teacher.key()]


class TeacherKLEvaluator:
    def __init__(self, renderer: ChatRenderer, problems: Sequence[RoutedProblem], routing: TeacherRouting,
                 service: ServiceFactory, max_tokens: int = 64, seed: int = 0):
        if not problems:
            raise ValueError("TeacherKLEvaluator got no held-out prompts")
        self.renderer, self.problems, self.max_tokens, self.seed = renderer, list(problems), max_tokens, seed
        self.teachers = _TeacherClients(routing, service)

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        completer = TokenCompleter(target.sampling_client(), SamplingSettings(max_tokens=self.max_tokens, temperature=1.0))
        prompts = [self.renderer.build_generation_prompt(_messages(item.problem)) for item in self.problems]
        stop = self.renderer.get_stop_sequences()
        sampled = [completer.submit(prompt, stop, seed=self.seed + index) for index, prompt in enumerate(prompts)]
        answers = [request.result()[0] for request in sampled]
        scored = [
            self.teachers.for_dataset(item.dataset).compute_logprobs(tinker.ModelInput.from_ints(prompt.to_ints() + list(answer.tokens)))
            for item, prompt, answer in zip(self.problems, prompts, answers)
            if answer.tokens
        ]
        kept = [(prompt, answer) for prompt, answer in zip(prompts, answers) if answer.tokens]
        total, tokens = 0.0, 0
        for (prompt, answer), future in zip(kept, scored):
            teacher = np.asarray(future.result()[prompt.length :], dtype=np.float64)
            total += float((np.asarray(answer.logprobs, dtype=np.float64) - teacher).sum())
            tokens += len(answer.tokens)
        return {"teacher_kl": total / tokens if tokens else float("nan"), "teacher_kl_tokens": float(tokens)}


class TeacherAccuracyEvaluator:
    def __init__(self, renderer: ChatRenderer, problems: Sequence[RoutedProblem], routing: TeacherRouting,
                 service: ServiceFactory, max_tokens: int = 64, seed: int = 0):
        self.renderer, self.problems, self.max_tokens, self.seed = renderer, list(problems), max_tokens, seed
        self.routing, self.teachers = routing, _TeacherClients(routing, service)
        self._score: dict[str, float] | None = None

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        if self._score is None:
            correct, count = 0.0, 0
            for dataset in sorted({item.dataset for item in self.problems}):
                problems = [item.problem for item in self.problems if item.dataset == dataset]
                teacher = EvalTarget(sampling_client=self.teachers.for_dataset(dataset))
                result = evaluate_accuracy(teacher, self.renderer, problems, max_tokens=self.max_tokens, seed=self.seed)
                correct += result.accuracy * result.num_samples
                count += result.num_samples
            self._score = {"teacher_accuracy": correct / count if count else float("nan")}
        return dict(self._score)
