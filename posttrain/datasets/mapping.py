"""Mapping one raw record of a known (or user-described) source onto a normalized row.

Each mapper takes `(record, where)` and returns the normalized fields of one row (without row_id,
source, split), or None when the record is valid but not usable as that kind of row (a HelpSteer3
tie has no preferred answer); it raises BadRowError for a broken record.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from posttrain.datasets.rows import BadRowError, normalize_messages, require_string

Mapper = Callable[[dict[str, Any], str], dict[str, Any] | None]

KINDS = ("chat", "comparison", "rl", "code")

DEFAULT_COLUMNS: dict[str, dict[str, str]] = {
    "chat": {"messages": "messages"},
    "comparison": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"},
    "rl": {"question": "question", "answer": "answer"},
    "code": {"prompt": "prompt", "tests": "tests", "entry_point": "entry_point", "test_code": "test_code"},
}
"""Column mapping used for a hub id or file that is not a preset. Override per field, e.g.
`{"prompt": "instruction", "completion": "output"}` for chat built from two text columns."""


# ---- chat -------------------------------------------------------------------------------------------


def chat_from_columns(columns: Mapping[str, str]) -> Mapper:
    """Chat rows from a `messages` column, or from `prompt` + `completion` (+ optional `system`) text."""
    if "messages" in columns:
        column = columns["messages"]

        def from_messages(record: dict, where: str) -> dict:
            if column not in record:
                raise BadRowError(where, f"missing column {column!r} (columns present: {sorted(record)})")
            return {"messages": normalize_messages(record[column], where)}

        return from_messages
    if "prompt" in columns and "completion" in columns:

        def from_text(record: dict, where: str) -> dict:
            messages = []
            if columns.get("system") and record.get(columns["system"]):
                messages.append({"role": "system", "content": require_string(record, columns["system"], where)})
            messages.append({"role": "user", "content": require_string(record, columns["prompt"], where)})
            messages.append({"role": "assistant", "content": require_string(record, columns["completion"], where)})
            return {"messages": messages}

        return from_text
    raise ValueError(
        f"chat column mapping {dict(columns)} needs 'messages', or 'prompt' and 'completion' (and optionally 'system')"
    )


# ---- comparisons --------------------------------------------------------------------------------------


def comparison(prompt: list, chosen: list, rejected: list, where: str) -> dict:
    """A validated comparison; identical completions carry no preference signal and are rejected."""
    prompt = normalize_messages(prompt, f"{where} prompt", need_assistant=False)
    chosen = normalize_messages(chosen, f"{where} chosen", need_assistant=False)
    rejected = normalize_messages(rejected, f"{where} rejected", need_assistant=False)
    if chosen == rejected:
        raise BadRowError(where, "chosen and rejected completions are identical")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def split_shared_prompt(chosen: list, rejected: list, where: str) -> dict:
    """Two full conversations that share everything but their last message -> prompt + completions."""
    chosen = normalize_messages(chosen, f"{where} chosen")
    rejected = normalize_messages(rejected, f"{where} rejected")
    if chosen[:-1] != rejected[:-1]:
        raise BadRowError(where, "chosen and rejected conversations do not share the same prompt turns")
    if chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant":
        raise BadRowError(where, "chosen and rejected conversations must both end with an assistant message")
    if not chosen[:-1]:
        raise BadRowError(where, "conversation has no prompt before the compared answers")
    return comparison(chosen[:-1], chosen[-1:], rejected[-1:], where)


def _as_messages(value: Any, role: str) -> Any:
    return [{"role": role, "content": value}] if isinstance(value, str) else value


def comparison_from_columns(columns: Mapping[str, str]) -> Mapper:
    """Comparisons from `prompt`/`chosen`/`rejected` columns holding text or message lists; without a
    prompt column, chosen and rejected are full conversations sharing their prompt turns."""

    def mapper(record: dict, where: str) -> dict:
        for field in ("chosen", "rejected"):
            if columns[field] not in record:
                raise BadRowError(where, f"missing column {columns[field]!r} (columns present: {sorted(record)})")
        chosen = _as_messages(record[columns["chosen"]], "assistant")
        rejected = _as_messages(record[columns["rejected"]], "assistant")
        prompt_column = columns.get("prompt")
        if prompt_column and prompt_column in record and not _is_full_conversation(chosen):
            return comparison(_as_messages(record[prompt_column], "user"), chosen, rejected, where)
        return split_shared_prompt(chosen, rejected, where)

    return mapper


def _is_full_conversation(messages: Any) -> bool:
    return isinstance(messages, list) and any(isinstance(m, dict) and m.get("role") == "user" for m in messages)


_HH_TURN = re.compile(r"\n\n(Human|Assistant): ")


def parse_hh_transcript(text: str, where: str) -> list[dict[str, str]]:
    """Anthropic hh-rlhf transcripts: "\\n\\nHuman: ...\\n\\nAssistant: ..." -> messages."""
    if not isinstance(text, str):
        raise BadRowError(where, f"transcript is {type(text).__name__}, expected a string")
    parts = _HH_TURN.split(text)
    if parts[0].strip():
        raise BadRowError(where, "transcript does not start with '\\n\\nHuman: '")
    roles = {"Human": "user", "Assistant": "assistant"}
    return [{"role": roles[parts[i]], "content": parts[i + 1].strip()} for i in range(1, len(parts) - 1, 2)]


def hh_rlhf(record: dict, where: str) -> dict:
    chosen = parse_hh_transcript(record.get("chosen"), f"{where} chosen")
    rejected = parse_hh_transcript(record.get("rejected"), f"{where} rejected")
    return split_shared_prompt(chosen, rejected, where)


def ultrafeedback(record: dict, where: str) -> dict:
    return split_shared_prompt(record.get("chosen"), record.get("rejected"), where)


def helpsteer3(record: dict, where: str) -> dict | None:
    """HelpSteer3 `preference`: overall_preference < 0 prefers response1, > 0 response2, 0 is a tie."""
    preference = record.get("overall_preference")
    if not isinstance(preference, int):
        raise BadRowError(where, f"overall_preference is {preference!r}, expected an integer in -3..3")
    if preference == 0:
        return None
    first = require_string(record, "response1", where)
    second = require_string(record, "response2", where)
    chosen, rejected = (first, second) if preference < 0 else (second, first)
    return comparison(record.get("context"), _as_messages(chosen, "assistant"), _as_messages(rejected, "assistant"), where)


def hhh_alignment(record: dict, where: str) -> dict:
    """BIG-bench HHH alignment: `input` and `targets: {choices, labels}` with label 1 on the better one."""
    question = require_string(record, "input", where)
    targets = record.get("targets") or {}
    choices, labels = targets.get("choices") or [], targets.get("labels") or []
    if len(choices) != 2 or sorted(labels) != [0, 1]:
        raise BadRowError(where, f"targets must hold two choices labelled 1 and 0, got labels {labels}")
    chosen = choices[labels.index(1)]
    rejected = choices[labels.index(0)]
    return comparison(
        [{"role": "user", "content": question}],
        _as_messages(chosen, "assistant"),
        _as_messages(rejected, "assistant"),
        where,
    )


# ---- RL problems ---------------------------------------------------------------------------------------


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The last number in a text, commas removed ("1,234" -> "1234"); None when there is none."""
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def gsm8k(record: dict, where: str) -> dict:
    """openai/gsm8k: the gold answer is the number after '####' in the worked solution."""
    question = require_string(record, "question", where)
    solution = require_string(record, "answer", where)
    if "####" not in solution:
        raise BadRowError(where, "answer has no '#### <number>' final answer")
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return {
        "task": "gsm8k",
        "question": question,
        "answer": answer,
        "scorer": "exact_number",
        "scorer_metadata": json.dumps({"solution": solution}),
    }


def rl_from_columns(columns: Mapping[str, str]) -> Mapper:
    def mapper(record: dict, where: str) -> dict:
        answer = record.get(columns["answer"])
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        else:
            answer = require_string(record, columns["answer"], where).strip()
        is_number = final_number(answer) == answer
        return {
            "task": str(record.get(columns.get("task", "task")) or "custom"),
            "question": require_string(record, columns["question"], where),
            "answer": answer,
            "scorer": "exact_number" if is_number else "exact_match",
            "scorer_metadata": "{}",
        }

    return mapper


# ---- code problems -------------------------------------------------------------------------------------


def _json_value(value: Any, where: str, column: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else None
        except json.JSONDecodeError as error:
            raise BadRowError(where, f"column {column!r} is not valid JSON ({error.msg})") from error
    return value


def normalize_io_tests(value: Any, where: str) -> tuple[list[dict[str, str]], str | None]:
    """Test cases in the DeepCoder / LiveCodeBench / TACO / PrimeIntellect shapes -> ([{input, output,
    kind}], function name or None). kind is "stdin" or "functional"."""
    value = _json_value(value, where, "tests")
    if isinstance(value, dict) and "inputs" in value:  # TACO / APPS: {"inputs": [...], "outputs": [...], "fn_name"?}
        fn_name = value.get("fn_name")
        kind = "functional" if fn_name else "stdin"
        pairs = zip(value.get("inputs") or [], value.get("outputs") or [], strict=False)
        tests = [{"input": _text(i), "output": _text(o), "kind": kind} for i, o in pairs]
        return tests, fn_name
    if not isinstance(value, list):
        raise BadRowError(where, f"tests must be a list of cases or a TACO {{inputs, outputs}} object, got {type(value).__name__}")
    tests, fn_name = [], None
    for case in value:
        if not isinstance(case, dict) or "input" not in case or "output" not in case:
            raise BadRowError(where, f"test case {case!r:.80} needs 'input' and 'output'")
        declared = case.get("testtype") or case.get("type") or "stdin"
        kind = "functional" if declared in ("functional", "function_call") else "stdin"
        fn_name = fn_name or case.get("fn_name")
        tests.append({"input": _text(case["input"]), "output": _text(case["output"]), "kind": kind})
    return tests, fn_name


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _code_row(prompt: str, tests: list, entry_point: str | None, where: str, **extra: str) -> dict:
    if not tests and not extra.get("test_code"):
        raise BadRowError(where, "problem has no tests")
    if any(t["kind"] == "functional" for t in tests) and not entry_point:
        raise BadRowError(where, "functional tests need a function name (metadata func_name / fn_name)")
    return {
        "prompt": prompt,
        "starter_code": extra.get("starter_code") or "",
        "entry_point": entry_point or "",
        "test_code": extra.get("test_code") or "",
        "tests": tests,
        "reference_solution": extra.get("reference_solution") or "",
    }


def deepcoder(record: dict, where: str) -> dict:
    """agentica-org/DeepCoder-Preview-Dataset: `problem`, `tests` (JSON), optional `metadata`/`starter_code`."""
    prompt = require_string(record, "problem", where)
    tests, fn_name = normalize_io_tests(record.get("tests"), where)
    metadata = _json_value(record.get("metadata"), where, "metadata") or {}
    entry_point = (metadata.get("func_name") if isinstance(metadata, dict) else None) or fn_name
    return _code_row(prompt, tests, entry_point, where, starter_code=record.get("starter_code") or "")


def livecodebench(record: dict, where: str) -> dict:
    """livecodebench/code_generation_lite: `question_content`, `starter_code`, `public_test_cases` (JSON),
    `metadata` (JSON with func_name). Private tests are a pickled blob there; unpickling hub data runs
    arbitrary code, so only the public tests are used."""
    prompt = require_string(record, "question_content", where)
    tests, _ = normalize_io_tests(record.get("public_test_cases"), where)
    metadata = _json_value(record.get("metadata"), where, "metadata") or {}
    entry_point = metadata.get("func_name") if isinstance(metadata, dict) else None
    return _code_row(prompt, tests, entry_point, where, starter_code=record.get("starter_code") or "")


def code_from_columns(columns: Mapping[str, str]) -> Mapper:
    def mapper(record: dict, where: str) -> dict:
        prompt = require_string(record, columns["prompt"], where)
        raw_tests = record.get(columns.get("tests", "tests"))
        tests, fn_name = normalize_io_tests(raw_tests, where) if raw_tests not in (None, "", []) else ([], None)
        entry_point = record.get(columns.get("entry_point", "entry_point")) or fn_name
        test_code = record.get(columns.get("test_code", "test_code")) or ""
        return _code_row(prompt, tests, entry_point, where, test_code=test_code)

    return mapper


def mapper_from_columns(kind: str, columns: Mapping[str, str] | None) -> Mapper:
    """The generic mapper of a kind, with the user's column mapping over the defaults."""
    if kind not in KINDS:
        raise ValueError(f"unknown dataset kind {kind!r}; expected one of {KINDS}")
    merged = {**DEFAULT_COLUMNS[kind], **(columns or {})}
    if kind == "chat" and columns and "messages" not in columns:
        merged.pop("messages")
    factory = {"chat": chat_from_columns, "comparison": comparison_from_columns, "rl": rl_from_columns, "code": code_from_columns}
    return factory[kind](merged)
