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


def sampler_of(row: dict) -> str:
    """The sampler path an on-policy comparison came from (its ``source``)."""
    source = str(row.get("source") or "")
    return source[len(SOURCE_PREFIX):] if source.startswith(SOURCE_PREFIX) else source


def samplers_in(table: pa.Table) -> list[str]:
    """The sampler paths of a comparisons table, in the order their rows first appear."""
    return list(dict.fromkeys(sampler_of(row) for row in table.select(["source"]).to_pylist()))


def accumulate_comparisons(kept: pa.Table, new: pa.Table) -> pa.Table:
    """``kept`` comparisons (an earlier version of the table: earlier policies' graded answers) followed by
    ``new`` ones (one more policy's), for a judge trained on every policy it has to grade — iterated RLHF,
    where each round's policy finds what the last judge over-rates.

    A prompt keeps one split across policies (a held-out prompt stays held out). New rows whose ``row_id`` is
    taken get ``@<n>`` (n = how many samplers the table already has), so ids stay unique. Raises
    ``ValueError`` when ``new``'s sampler is already in ``kept`` (its comparisons would count twice) or a
    prompt would be in both splits (the kept rows came from another split of the problems)."""
    kept_rows, new_rows = kept.to_pylist(), new.to_pylist()
    samplers = samplers_in(kept)
    repeated = sorted(set(samplers_in(new)) & set(samplers))
    if repeated:
        raise ValueError(f"the kept comparisons already hold the answers of {', '.join(repeated)}: sample another "
                         "checkpoint, or materialize without accumulate to start a new table")
    split_of = {_prompt_key(row): row["split"] for row in kept_rows}
    clashes = sorted(str(row["row_id"]) for row in new_rows
                     if split_of.get(_prompt_key(row), row["split"]) != row["split"])
    if clashes:
        raise ValueError(f"{len(clashes)} prompt(s) are held out in one table and trained on in the other (first: "
                         f"{clashes[0]}): the kept comparisons were split from another rl_problems version; materialize "
                         "without accumulate to start a new table")
    taken = {row["row_id"] for row in kept_rows}
    renamed = [{**row, "row_id": f"{row['row_id']}@{len(samplers)}"} if row["row_id"] in taken else row for row in new_rows]
    return schemas.table_from_rows(kept_rows + renamed, schemas.PREFERENCE_COMPARISONS)


def _prompt_key(row: dict) -> str:
    return repr([(m["role"], m["content"]) for m in row["prompt"]])
