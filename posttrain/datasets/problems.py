"""Typed views of the `rl_problems` and `code_problems` tables, for RL environments and evaluators.

`RLProblem.grade(answer)` scores an extracted final answer with the row's own scorer:
"reasoning_gym:<task>" uses that task's `score_answer` (1.0 = correct, small credit for a well-formed
wrong answer on some tasks); "exact_number" compares values with math-verify (`1,000` = `1000.0`,
`3/4` = `0.75`); "exact_match" compares text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from posttrain.eval.math_answers import same_value

REASONING_GYM_SCORER = "reasoning_gym:"


def score_problem(scorer: str, metadata_json: str, gold: str, answer: str) -> float:
    """Grade `answer` against a problem's gold answer with the named scorer."""
    if scorer.startswith(REASONING_GYM_SCORER):
        from posttrain.datasets.reasoning_tasks import score

        return score(scorer.removeprefix(REASONING_GYM_SCORER), answer, json.loads(metadata_json))
    if scorer == "exact_number":
        return 1.0 if same_value(answer, gold) else 0.0
    if scorer == "exact_match":
        return 1.0 if answer.strip() == gold.strip() else 0.0
    raise ValueError(f"unknown scorer {scorer!r}; expected reasoning_gym:<task>, exact_number or exact_match")


def _rows(table: pa.Table, split: str | None) -> list[dict]:
    if split is not None:
        table = table.filter(pc.equal(table.column("split"), split))
    return table.to_pylist()


@dataclass(frozen=True)
class RLProblem:
    row_id: str
    split: str
    task: str
    question: str
    answer: str
    scorer: str
    scorer_metadata: str

    def grade(self, answer: str) -> float:
        return score_problem(self.scorer, self.scorer_metadata, self.answer, answer)


def rl_problems_from_table(table: pa.Table, split: str | None = None) -> list[RLProblem]:
    """The rows of an `rl_problems` table (optionally one split) as RLProblem."""
    return [RLProblem(**{k: row[k] for k in RLProblem.__dataclass_fields__}) for row in _rows(table, split)]


@dataclass(frozen=True)
class IOTest:
    input: str
    output: str
    kind: str  # "stdin": feed input, compare stdout; "functional": call entry_point with JSON-decoded input lines


@dataclass(frozen=True)
class CodeProblem:
    row_id: str
    split: str
    prompt: str
    starter_code: str
    entry_point: str
    test_code: str
    tests: tuple[IOTest, ...]
    reference_solution: str


def code_problems_from_table(table: pa.Table, split: str | None = None) -> list[CodeProblem]:
    """The rows of a `code_problems` table (optionally one split) as CodeProblem."""
    problems = []
    for row in _rows(table, split):
        fields = {k: row[k] for k in CodeProblem.__dataclass_fields__ if k != "tests"}
        problems.append(CodeProblem(tests=tuple(IOTest(**t) for t in row["tests"]), **fields))
    return problems
