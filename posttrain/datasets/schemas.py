"""The normalized Arrow schemas every dataset in the project is converted to.

Loaders map each source's own columns onto one of these tables, so renderers, trainers and evaluators
read one shape whatever the data came from. Every table has `row_id` (stable, unique within the table)
and `source` (where the row came from: preset name, file or generator).

`split` is "train" or "heldout": a row is held out when a hash of its normalized prompt falls below
`heldout_fraction` (see `posttrain.datasets.splits`), so it stays held out when `limit` or the source
order changes, and rows sharing a prompt share a split.
Trainers filter `split == "train"`; evaluators read `split == "heldout"`.
"""

from __future__ import annotations

import pyarrow as pa

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
MESSAGES = pa.list_(MESSAGE)

TOOL_CALL = pa.struct(
    [("id", pa.string()), ("type", pa.string()), ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))]
)
TOOL_MESSAGE = pa.struct(
    [("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.list_(TOOL_CALL)),
     ("tool_call_id", pa.string()), ("name", pa.string())]
)
TOOL_MESSAGES = pa.list_(TOOL_MESSAGE)
"""Messages with tool calls (OpenAI's shape, arguments as JSON text) and tool results' call ids. A table
uses these in place of MESSAGES only when one of its rows has a tool field, so tables without tools (and
their digests) are unchanged; a MESSAGES column of a schema accepts TOOL_MESSAGES."""

TRAIN_SPLIT = "train"
HELDOUT_SPLIT = "heldout"

CHAT = pa.schema(
    [
        ("row_id", pa.string()),
        ("source", pa.string()),
        ("split", pa.string()),
        ("messages", MESSAGES),
    ],
    metadata={"posttrain.schema": "chat"},
)
"""One conversation per row; the trained part is chosen later by the renderer's TrainOnWhat."""

RENDERED_TOKENS = pa.schema(
    [
        ("row_id", pa.string()),
        ("source_row_id", pa.string()),
        ("split", pa.string()),
        ("model_input", pa.list_(pa.int32())),
        ("target_tokens", pa.list_(pa.int32())),
        ("weights", pa.list_(pa.float32())),
        ("num_tokens", pa.int32()),
        ("num_trained_tokens", pa.int32()),
        ("truncated", pa.bool_()),
    ],
    metadata={"posttrain.schema": "rendered_tokens"},
)
"""One supervised example per row, already shifted: `model_input[i]` predicts `target_tokens[i]` with
loss weight `weights[i]` (raw 0/1 mask; the trainer applies its own reduction). `num_tokens` is the
full rendered length (len(model_input) + 1); `truncated` says the conversation was cut at max_length."""

PREFERENCE_COMPARISONS = pa.schema(
    [
        ("row_id", pa.string()),
        ("source", pa.string()),
        ("split", pa.string()),
        ("prompt", MESSAGES),
        ("chosen", MESSAGES),
        ("rejected", MESSAGES),
    ],
    metadata={"posttrain.schema": "preference_comparisons"},
)
"""A shared prompt conversation and two continuations (usually one assistant message each)."""

PREFERENCE_PAIRS = pa.schema(
    [
        ("row_id", pa.string()),
        ("source_row_id", pa.string()),
        ("split", pa.string()),
        ("prompt_length", pa.int32()),
        ("chosen_model_input", pa.list_(pa.int32())),
        ("chosen_target_tokens", pa.list_(pa.int32())),
        ("chosen_weights", pa.list_(pa.float32())),
        ("rejected_model_input", pa.list_(pa.int32())),
        ("rejected_target_tokens", pa.list_(pa.int32())),
        ("rejected_weights", pa.list_(pa.float32())),
        ("chosen_num_trained_tokens", pa.int32()),
        ("rejected_num_trained_tokens", pa.int32()),
        ("truncated", pa.bool_()),
    ],
    metadata={"posttrain.schema": "preference_pairs"},
)
"""Rendered chosen/rejected sequences of one comparison. Both start with the same `prompt_length`
tokens of the rendered prompt (checked), and only completion tokens carry weight (DPO sums them)."""

RL_PROBLEMS = pa.schema(
    [
        ("row_id", pa.string()),
        ("source", pa.string()),
        ("split", pa.string()),
        ("task", pa.string()),
        ("question", pa.string()),
        ("answer", pa.string()),
        ("scorer", pa.string()),
        ("scorer_metadata", pa.string()),
    ],
    metadata={"posttrain.schema": "rl_problems"},
)
"""A question with a verifiable gold answer. `scorer` names how an answer is graded
("reasoning_gym:<task>" scores with that task's own `score_answer`; "exact_number" compares the final
number); `scorer_metadata` is the JSON the scorer needs (reasoning-gym's entry metadata)."""

IO_TEST = pa.struct([("input", pa.string()), ("output", pa.string()), ("kind", pa.string())])

CODE_PROBLEMS = pa.schema(
    [
        ("row_id", pa.string()),
        ("source", pa.string()),
        ("split", pa.string()),
        ("prompt", pa.string()),
        ("starter_code", pa.string()),
        ("entry_point", pa.string()),
        ("test_code", pa.string()),
        ("tests", pa.list_(IO_TEST)),
        ("reference_solution", pa.string()),
    ],
    metadata={"posttrain.schema": "code_problems"},
)
"""A programming problem. Either `test_code` (a Python program defining `check(candidate)`, HumanEval
style, run against `entry_point`) or `tests` (input/output cases; kind "stdin" feeds stdin and compares
stdout, kind "functional" calls `entry_point` with the JSON-decoded input lines) or both."""

ALL = {
    "chat": CHAT,
    "rendered_tokens": RENDERED_TOKENS,
    "preference_comparisons": PREFERENCE_COMPARISONS,
    "preference_pairs": PREFERENCE_PAIRS,
    "rl_problems": RL_PROBLEMS,
    "code_problems": CODE_PROBLEMS,
}


class SchemaMismatch(ValueError):
    """A table does not have the normalized schema it claims to have."""


def schema_problems(table: pa.Table, expected: pa.Schema) -> list[str]:
    """Every way `table` differs from `expected` (column names, order, types); empty when valid."""
    problems = []
    actual = {field.name: field.type for field in table.schema}
    for field in expected:
        if field.name not in actual:
            problems.append(f"missing column {field.name!r} ({field.type})")
        elif field.type == MESSAGES and actual[field.name] == TOOL_MESSAGES:
            continue
        elif actual[field.name] != field.type:
            problems.append(f"column {field.name!r} is {actual[field.name]}, expected {field.type}")
    extra = [name for name in actual if name not in expected.names]
    if extra:
        problems.append(f"unexpected columns {extra}")
    return problems


def validate_table(table: pa.Table, expected: pa.Schema) -> None:
    """Raise SchemaMismatch naming each problem, so a wrong table never reaches the trainer."""
    problems = schema_problems(table, expected)
    if problems:
        name = (expected.metadata or {}).get(b"posttrain.schema", b"?").decode()
        raise SchemaMismatch(f"table does not match the {name!r} schema: " + "; ".join(problems))


def table_from_rows(rows: list[dict], schema: pa.Schema) -> pa.Table:
    """Build a table from row dicts with the exact schema (types enforced by Arrow, not guessed); its
    messages columns become TOOL_MESSAGES when a message has a tool field (Arrow would drop it silently)."""
    message_columns = [field.name for field in schema if field.type == MESSAGES]
    if any(_has_tool_fields(row.get(name) or []) for row in rows for name in message_columns):
        schema = pa.schema(
            [pa.field(f.name, TOOL_MESSAGES if f.name in message_columns else f.type, f.nullable) for f in schema],
            metadata=schema.metadata,
        )
    return pa.Table.from_pylist(rows, schema=schema)


def _has_tool_fields(messages: list[dict]) -> bool:
    return any(message.get(key) for message in messages for key in ("tool_calls", "tool_call_id", "name"))
