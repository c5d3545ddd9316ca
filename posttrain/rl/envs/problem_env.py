"""Single-turn question -> answer environments, graded by the problem's own scorer.

The model sees ``[system?, user: question]`` rendered as a generation prompt and answers in one turn.
Reward (cookbook's ProblemEnv): ``format_coef·(format_ok − 1) + score``, where ``format_ok`` means the
turn ended with the renderer's stop sequence *and* an answer could be extracted from it
(``posttrain.eval.answers.extract_answer``: ``\\boxed{}``, ``####``, "answer is", else the last number),
and ``score`` is the problem's grade of that answer in [0, 1] (1 = correct; reasoning-gym tasks may
give partial credit). A group is G copies of one problem, so advantages compare answers to the same
question.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from posttrain.completers import ChatRenderer, StopCondition, is_well_formed, message_text
from posttrain.datasets.problems import RLProblem
from posttrain.eval.answers import extract_answer
from posttrain.eval.math_answers import same_value
from posttrain.rl.types import Action, Env, EnvGroupBuilder, Observation, StepResult

CORRECT_SCORE = 0.99
DEFAULT_FORMAT_COEF = 0.1

Grader = Callable[[str], float]
"""Extracted answer -> score in [0, 1]."""


def grader_for(problem: RLProblem) -> Grader:
    """The row's own scorer when it names one, else math-verify's equality with the gold answer."""
    if problem.scorer:
        return problem.grade
    return lambda answer: 1.0 if same_value(answer, problem.answer) else 0.0


class ProblemEnv(Env):
    def __init__(
        self,
        renderer: ChatRenderer,
        question: str,
        grade: Grader,
        *,
        system: str | None = None,
        format_coef: float = DEFAULT_FORMAT_COEF,
    ):
        self.renderer = renderer
        self.question = question
        self.grade = grade
        self.system = system
        self.format_coef = format_coef

    def messages(self) -> list[dict[str, str]]:
        prefix = [{"role": "system", "content": self.system}] if self.system else []
        return prefix + [{"role": "user", "content": self.question}]

    def initial_observation(self) -> tuple[Observation, StopCondition]:
        return self.renderer.build_generation_prompt(self.messages()), self.renderer.get_stop_sequences()

    def step(self, action: Action) -> StepResult:
        message, termination = self.renderer.parse_response(list(action))
        answer = extract_answer(message_text(message))
        format_ok = is_well_formed(termination) and answer is not None
        score = float(self.grade(answer)) if answer is not None else 0.0
        reward = self.format_coef * (float(format_ok) - 1.0) + score
        return StepResult(
            reward=reward,
            episode_done=True,
            metrics={"format": float(format_ok), "score": score, "correct": float(score >= CORRECT_SCORE)},
        )


@dataclass(frozen=True)
class ProblemGroupBuilder(EnvGroupBuilder):
    """``group_size`` envs for one problem."""

    renderer: ChatRenderer
    problem: RLProblem
    group_size: int
    format_coef: float = DEFAULT_FORMAT_COEF
    system: str | None = None

    def make_envs(self) -> Sequence[Env]:
        grade = grader_for(self.problem)
        return [
            ProblemEnv(self.renderer, self.problem.question, grade, system=self.system, format_coef=self.format_coef)
            for _ in range(self.group_size)
        ]

    def logging_tags(self) -> list[str]:
        return [self.problem.task] if self.problem.task else []
