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
from posttrain.eval.accuracy import TaskProblem, evaluate_accuracy, problem_keys
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
        per_prompt = self._per_prompt(target)
        total = sum(kl_sum for kl_sum, _ in per_prompt.values())
        tokens = sum(count for _, count in per_prompt.values())
        return {"teacher_kl": total / tokens if tokens else float("nan"), "teacher_kl_tokens": float(tokens)}

    def score_items(self, target: EvalTarget) -> dict[str, dict[str, float]]:
        """Per held-out prompt (keyed by its hash): the mean over the answer's tokens of lp_target − lp_teacher."""
        return {"teacher_kl": {key: kl_sum / count for key, (kl_sum, count) in self._per_prompt(target).items()}}

    def _per_prompt(self, target: EvalTarget) -> dict[str, tuple[float, int]]:
        """Prompt key -> (Σ over sampled tokens of lp_target − lp_teacher, tokens); empty answers left out."""
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
        keys = problem_keys([item.problem for item in self.problems])
        kept = [(key, prompt, answer) for key, prompt, answer in zip(keys, prompts, answers) if answer.tokens]
        found = {}
        for (key, prompt, answer), future in zip(kept, scored):
            teacher = np.asarray(future.result()[prompt.length :], dtype=np.float64)
            found[key] = (float((np.asarray(answer.logprobs, dtype=np.float64) - teacher).sum()), len(answer.tokens))
        return found


class TeacherAccuracyEvaluator:
    def __init__(self, renderer: ChatRenderer, problems: Sequence[RoutedProblem], routing: TeacherRouting,
                 service: ServiceFactory, max_tokens: int = 64, seed: int = 0):
        self.renderer, self.problems, self.max_tokens, self.seed = renderer, list(problems), max_tokens, seed
        self.routing, self.teachers = routing, _TeacherClients(routing, service)
        self._items: dict[str, float] | None = None

    def score_items(self, target: EvalTarget) -> dict[str, dict[str, float]]:
        """Per held-out prompt (keyed by its hash): whether its teacher answers it correctly (the same for every target)."""
        if self._items is None:
            keys = dict(zip((id(item) for item in self.problems), problem_keys([item.problem for item in self.problems])))
            self._items = {}
            for dataset in sorted({item.dataset for item in self.problems}):
                routed = [item for item in self.problems if item.dataset == dataset]
                teacher = EvalTarget(sampling_client=self.teachers.for_dataset(dataset))
                result = evaluate_accuracy(teacher, self.renderer, [item.problem for item in routed], max_tokens=self.max_tokens, seed=self.seed)
                self._items.update({keys[id(item)]: float(row.correct) for item, row in zip(routed, result.rows)})
        return {"teacher_accuracy": dict(self._items)}

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        items = self.score_items(target)["teacher_accuracy"]
        return {"teacher_accuracy": sum(items.values()) / len(items) if items else float("nan")}
