"""On-policy preference pairs: sample a checkpoint, let the task's verifier pick chosen and rejected.

For each problem of an ``rl_problems`` table the checkpoint answers ``num_samples`` times (one request
with ``num_samples`` per prompt, every request submitted before any is awaited, via
``posttrain.eval.accuracy.evaluate_accuracy``); each answer is graded with the row's own scorer. A
prompt with at least one correct and one incorrect answer gives one pair (a correct answer chosen, an
incorrect one rejected, picked by a generator seeded with ``(seed, row_id)`` so the choice does not
depend on the order of the table). Prompts whose answers are all correct or all incorrect carry no
preference: they are dropped and counted, because a low pair yield says the task is too easy or too
hard for the checkpoint.

The output is a ``preference_comparisons`` table (messages: the prompt, one assistant message per
side), the same shape as offline comparisons, so the ``preference_pairs`` asset renders either. The
sampler checkpoint is recorded in each row's ``source`` (``onpolicy:<sampler path>``) and in the result.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa
import tinker

from posttrain.datasets import schemas
from posttrain.eval.accuracy import ChatRenderer, SampleGrade, TaskProblem, default_grade, evaluate_accuracy, problems_from_table
from posttrain.eval.base import EvalTarget

SOURCE_PREFIX = "onpolicy:"


@dataclass(frozen=True)
class OnPolicyPairs:
    table: pa.Table  # schemas.PREFERENCE_COMPARISONS
    sampler_path: str
    num_prompts: int
    dropped_all_correct: int
    dropped_none_correct: int
    sample_accuracy: float  # fraction of all samples graded correct

    @property
    def num_pairs(self) -> int:
        return self.table.num_rows

    def metrics(self, prefix: str = "onpolicy/") -> dict[str, float]:
        return {
            f"{prefix}num_prompts": float(self.num_prompts),
            f"{prefix}num_pairs": float(self.num_pairs),
            f"{prefix}dropped_all_correct": float(self.dropped_all_correct),
            f"{prefix}dropped_none_correct": float(self.dropped_none_correct),
            f"{prefix}sample_accuracy": self.sample_accuracy,
        }


def _generator(seed: int, row_id: str) -> np.random.Generator:
    return np.random.default_rng([seed, int.from_bytes(hashlib.sha256(row_id.encode()).digest()[:8], "little")])


def _prompt_messages(problem: TaskProblem) -> list[dict[str, str]]:
    system = [{"role": "system", "content": problem.system}] if problem.system else []
    return system + [{"role": "user", "content": problem.question}]


def build_onpolicy_pairs(
    service_client: tinker.ServiceClient,
    sampler_path: str,
    renderer: ChatRenderer,
    problems: pa.Table,
    *,
    split: str | None = schemas.TRAIN_SPLIT,
    num_samples: int = 4,
    max_tokens: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    grade: Callable[[str | None, TaskProblem], float] = default_grade,
) -> OnPolicyPairs:
    """Pairs from ``sampler_path``'s answers to the ``split`` rows of an ``rl_problems`` table."""
    if num_samples < 2:
        raise ValueError(f"num_samples must be at least 2 to find a correct and an incorrect answer, got {num_samples}")
    task_problems = problems_from_table(problems, split=split)
    if not task_problems:
        raise ValueError(f"the problems table has no {split!r} rows to sample: check its split column")
    splits = dict(zip(problems.column("row_id").to_pylist(), problems.column("split").to_pylist()))
    target = EvalTarget.from_checkpoint(service_client, sampler_path)
    graded = evaluate_accuracy(
        target, renderer, task_problems, max_tokens=max_tokens, num_samples=num_samples,
        temperature=temperature, top_k=-1, seed=seed, grade=grade,
    )
    by_problem: dict[str, list[SampleGrade]] = {}
    for row in graded.rows:
        by_problem.setdefault(row.row_id, []).append(row)
    rows, all_correct, none_correct = [], 0, 0
    for problem in task_problems:
        samples = by_problem[problem.row_id]
        correct = [s.response for s in samples if s.correct]
        incorrect = [s.response for s in samples if not s.correct]
        if not incorrect:
            all_correct += 1
            continue
        if not correct:
            none_correct += 1
            continue
        generator = _generator(seed, problem.row_id)
        rows.append(
            {
                "row_id": problem.row_id,
                "source": SOURCE_PREFIX + sampler_path,
                "split": splits[problem.row_id],
                "prompt": _prompt_messages(problem),
                "chosen": [{"role": "assistant", "content": correct[int(generator.integers(len(correct)))]}],
                "rejected": [{"role": "assistant", "content": incorrect[int(generator.integers(len(incorrect)))]}],
            }
        )
    return OnPolicyPairs(
        table=schemas.table_from_rows(rows, schemas.PREFERENCE_COMPARISONS),
        sampler_path=sampler_path,
        num_prompts=len(task_problems),
        dropped_all_correct=all_correct,
        dropped_none_correct=none_correct,
        sample_accuracy=graded.accuracy,
    )
