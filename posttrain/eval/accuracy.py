"""Sampled task accuracy with a renderer-aware answer check.

For each problem, a :class:`~posttrain.completers.MessageCompleter` renders ``[system?, user: question]``
with the renderer's generation prompt, samples with the renderer's stop sequences (so a chat model stops
at its end-of-turn, not at ``max_tokens``) and parses the tokens back into an assistant message; we extract the final
answer (``posttrain.eval.answers.extract_answer``) and grade it: with the problem's own scorer when it
names one (``reasoning_gym:<task>``, ``exact_number``... via ``posttrain.datasets.problems``),
else by :func:`~posttrain.eval.math_answers.same_value` (math-verify) against the gold answer.

Every request is submitted before any result is awaited. Greedy by default (``top_k=1``, which every
Tinker backend honours) so an eval report is reproducible.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from posttrain.completers import ChatRenderer, MessageCompleter, SamplingSettings, TokenCompleter
from posttrain.eval.answers import extract_answer
from posttrain.eval.base import EvalTarget
from posttrain.eval.items import unique_keys
from posttrain.eval.math_answers import same_value

CORRECT_SCORE = 0.99


@dataclass(frozen=True)
class TaskProblem:
    question: str
    answer: str
    row_id: str = ""
    system: str | None = None
    scorer: str | None = None  # e.g. "reasoning_gym:basic_arithmetic"; None = same_value (math-verify)
    scorer_metadata: str = "{}"


def problems_from_table(table: Any, split: str | None = "heldout", limit: int | None = None) -> list[TaskProblem]:
    """``TaskProblem`` rows from an RL-problems Arrow table (``posttrain.datasets.schemas.RL_PROBLEMS``)."""
    rows = table.to_pylist()
    if split is not None and "split" in table.column_names:
        rows = [row for row in rows if row["split"] == split]
    problems = [
        TaskProblem(
            question=row["question"],
            answer=str(row["answer"]),
            row_id=row.get("row_id", ""),
            scorer=row.get("scorer"),
            scorer_metadata=row.get("scorer_metadata") or "{}",
        )
        for row in rows
    ]
    return problems[:limit] if limit is not None else problems


@dataclass
class SampleGrade:
    row_id: str
    question: str
    gold: str
    response: str
    extracted: str | None
    score: float
    correct: bool
    well_formed: bool
    num_tokens: int
    stop_reason: str


@dataclass
class AccuracyResult:
    accuracy: float
    mean_score: float
    well_formed_rate: float
    num_samples: int
    rows: list[SampleGrade] = field(default_factory=list)

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        return {
            f"{prefix}accuracy": self.accuracy,
            f"{prefix}mean_score": self.mean_score,
            f"{prefix}well_formed": self.well_formed_rate,
            f"{prefix}num_samples": float(self.num_samples),
        }

    def row_dicts(self) -> list[dict[str, Any]]:
        return [asdict(row) for row in self.rows]


def default_grade(extracted: str | None, problem: TaskProblem) -> float:
    """The problem's own scorer when it names one, else math-verify's equality with the gold answer."""
    if problem.scorer:
        from posttrain.datasets.problems import score_problem

        return float(score_problem(problem.scorer, problem.scorer_metadata, problem.answer, extracted or ""))
    return 1.0 if same_value(extracted, problem.answer) else 0.0


def evaluate_accuracy(
    target: EvalTarget,
    renderer: ChatRenderer,
    problems: Sequence[TaskProblem],
    *,
    max_tokens: int = 64,
    num_samples: int = 1,
    temperature: float = 1.0,
    top_k: int = 1,
    seed: int = 0,
    grade: Callable[[str | None, TaskProblem], float] = default_grade,
) -> AccuracyResult:
    if not problems:
        raise ValueError("evaluate_accuracy got no problems: pass at least one TaskProblem")
    completer = MessageCompleter(
        TokenCompleter(target.sampling_client(), SamplingSettings(max_tokens=max_tokens, temperature=temperature, top_k=top_k)),
        renderer,
    )
    pending = [completer.submit(_messages(problem), num_samples=num_samples, seed=seed) for problem in problems]
    rows = []
    for problem, request in zip(problems, pending):
        for completion in request.result():
            extracted = extract_answer(completion.text)
            score = grade(extracted, problem)
            rows.append(
                SampleGrade(
                    row_id=problem.row_id,
                    question=problem.question,
                    gold=problem.answer,
                    response=completion.text,
                    extracted=extracted,
                    score=score,
                    correct=score >= CORRECT_SCORE,
                    well_formed=completion.well_formed,
                    num_tokens=len(completion.sampled.tokens),
                    stop_reason=completion.sampled.stop_reason,
                )
            )
    count = len(rows)
    return AccuracyResult(
        accuracy=sum(row.correct for row in rows) / count,
        mean_score=sum(row.score for row in rows) / count,
        well_formed_rate=sum(row.well_formed for row in rows) / count,
        num_samples=count,
        rows=rows,
    )


class AccuracyEvaluator:
    """An :class:`~posttrain.eval.base.Evaluator` reporting ``{prefix}accuracy`` and friends.

    ``renderer`` may be a renderer name (``posttrain.renderers.get_renderer``): it is then built on first
    use over the target's tokenizer. ``sampling`` goes to :func:`evaluate_accuracy` (max_tokens, ...).
    ``format_coef``: also report ``{prefix}reward``, the RL env's own reward of each answer
    (``format_coef·(well_formed − 1) + score``, as ``posttrain.rl.envs.problem_env`` grades it).
    """

    def __init__(
        self,
        renderer: ChatRenderer | str,
        problems: Sequence[TaskProblem],
        prefix: str = "eval/",
        format_coef: float | None = None,
        **sampling: Any,
    ):
        self.renderer = renderer
        self.problems = list(problems)
        self.prefix = prefix
        self.format_coef = format_coef
        self.sampling = sampling

    def _evaluate(self, target: EvalTarget) -> AccuracyResult:
        if isinstance(self.renderer, str):
            from posttrain.renderers import get_renderer

            self.renderer = get_renderer(self.renderer, target.tokenizer())
        return evaluate_accuracy(target, self.renderer, self.problems, **self.sampling)

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        return self._evaluate(target).metrics(self.prefix)

    def score_items(self, target: EvalTarget) -> dict[str, dict[str, float]]:
        """Per held-out problem (keyed by its prompt's hash): correct, well formed and, with ``format_coef``, reward."""
        rows_P = per_problem(self._evaluate(target).rows, len(self.problems))
        keys = problem_keys(self.problems)
        scores = {
            f"{self.prefix}accuracy": {key: _mean([r.correct for r in rows]) for key, rows in zip(keys, rows_P)},
            f"{self.prefix}well_formed": {key: _mean([r.well_formed for r in rows]) for key, rows in zip(keys, rows_P)},
        }
        if self.format_coef is not None:
            coef = self.format_coef
            scores[f"{self.prefix}reward"] = {
                key: _mean([coef * (float(r.well_formed and r.extracted is not None) - 1.0) + r.score for r in rows])
                for key, rows in zip(keys, rows_P)
            }
        return scores


def problem_keys(problems: Sequence[TaskProblem]) -> list[str]:
    """Item keys of problems: the hash of what the model is asked (system prompt and question)."""
    return unique_keys(f"{p.system or ''}\n{p.question}" for p in problems)


def per_problem(rows: Sequence[SampleGrade], num_problems: int) -> list[list[SampleGrade]]:
    """``evaluate_accuracy``'s rows (problem-major, equal samples per problem) grouped by problem."""
    per = len(rows) // num_problems
    return [list(rows[index * per : (index + 1) * per]) for index in range(num_problems)]


def _mean(values: Sequence[float | bool]) -> float:
    return sum(float(v) for v in values) / len(values)


def _messages(problem: TaskProblem) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": problem.system}] if problem.system else []
    return messages + [{"role": "user", "content": problem.question}]
