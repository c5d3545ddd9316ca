"""Verifiable reasoning tasks generated at run time by the PyPI package `reasoning-gym`.

Each task (basic_arithmetic, chain_sum, gsm_symbolic, ...) yields a question, its gold answer and a
scorer (`score_answer(answer, entry) -> [0, 1]`). From those we build, with no download:
- RL problems (question + gold answer + the name of the task whose scorer grades it),
- chat SFT examples (user: question, assistant: gold answer),
- preference comparisons: chosen = the gold answer (scored 1.0), rejected = a wrong answer of the same
  form (a nearby number, scored as wrong by the same scorer), so DPO has a real, checkable signal.

Row ids are `reasoning_gym/<task>/seed<seed>/<index>`: the same task, seed and index always give the
same question, so ids are stable across runs.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from posttrain.datasets.mapping import final_number
from posttrain.datasets.problems import score_problem  # noqa: F401  (re-exported: eval code imports it from here)

SOURCE_PREFIX = "reasoning_gym:"
DEFAULT_TASKS = ("basic_arithmetic", "chain_sum", "gsm_symbolic")
WRONG_SCORE_MAX = 0.1
"""An answer counts as wrong when its task scores it at most this: some scorers give a little credit for
a well-formed wrong number (gsm_symbolic gives 0.01), none give partial credit for a different value."""


@dataclass(frozen=True)
class TaskEntry:
    task: str
    seed: int
    index: int
    entry: dict[str, Any]
    variant: str = ""  # the task's option string ("min_terms=2&max_digits=2"), part of the row id

    @property
    def row_id(self) -> str:
        task = f"{self.task}?{self.variant}" if self.variant else self.task
        return f"reasoning_gym/{task}/seed{self.seed}/{self.index}"


def parse_tasks(source: str) -> tuple[str, ...]:
    """"reasoning_gym:basic_arithmetic?max_digits=2,chain_sum" -> the task specs (all tasks by default).

    A task may carry reasoning-gym config options as ``?key=value&key=value`` (ints, floats, true/false,
    else strings), e.g. ``basic_arithmetic?min_terms=2&max_terms=2&max_digits=2&operators=+`` for
    "Calculate 43 + 12." problems a 135M model can learn within a demo.
    """
    names = source.removeprefix(SOURCE_PREFIX).strip()
    tasks = tuple(t.strip() for t in names.split(",") if t.strip()) or DEFAULT_TASKS
    known = _registered_tasks()
    unknown = [t for t in tasks if split_task(t)[0] not in known]
    if unknown:
        raise ValueError(f"{source!r}: unknown reasoning-gym task(s) {unknown}; e.g. {', '.join(DEFAULT_TASKS)}")
    return tasks


def split_task(spec: str) -> tuple[str, str]:
    """"basic_arithmetic?max_digits=2" -> ("basic_arithmetic", "max_digits=2")."""
    name, _, variant = spec.partition("?")
    return name.strip(), variant.strip()


def task_options(spec: str) -> dict[str, Any]:
    """The config keyword arguments a task spec names; says which part is malformed."""
    options: dict[str, Any] = {}
    for part in filter(None, split_task(spec)[1].split("&")):
        key, sep, raw = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"reasoning-gym task {spec!r}: option {part!r} is not key=value")
        options[key.strip()] = _option_value(raw.strip())
    return options


def _option_value(raw: str) -> Any:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for parse in (int, float):
        try:
            return parse(raw)
        except ValueError:
            pass
    return raw


def _registered_tasks() -> frozenset[str]:
    from reasoning_gym.factory import DATASETS

    return frozenset(DATASETS)


def generate(tasks: tuple[str, ...], size: int, seed: int) -> Iterator[TaskEntry]:
    """`size` entries spread evenly over the tasks, task by task."""
    import reasoning_gym

    for position, spec in enumerate(tasks):
        count = size // len(tasks) + (1 if position < size % len(tasks) else 0)
        if count == 0:
            continue
        task, variant = split_task(spec)
        try:
            dataset = reasoning_gym.create_dataset(task, size=count, seed=seed, **task_options(spec))
        except (TypeError, AssertionError) as error:
            raise ValueError(f"reasoning-gym task {spec!r}: invalid options ({error})") from error
        for index in range(count):
            yield TaskEntry(task=task, seed=seed, index=index, entry=dataset[index], variant=variant)


@lru_cache(maxsize=None)
def _scorer(task: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def score(task: str, answer: str | None, entry: dict[str, Any]) -> float:
    """The task's own score for an answer (1.0 = correct)."""
    return float(_scorer(task)(answer, entry))


def scorer_metadata(entry: dict[str, Any]) -> str:
    """What `score` needs to grade later, as JSON (tuples become lists; scorers only read values)."""
    return json.dumps({"question": entry["question"], "answer": entry["answer"], "metadata": entry["metadata"]}, default=str)


def rl_row(item: TaskEntry) -> dict[str, Any]:
    return {
        "row_id": item.row_id,
        "source": f"{SOURCE_PREFIX}{item.task}",
        "task": item.task,
        "question": item.entry["question"],
        "answer": str(item.entry["answer"]),
        "scorer": f"{SOURCE_PREFIX}{item.task}",
        "scorer_metadata": scorer_metadata(item.entry),
    }


def chat_row(item: TaskEntry) -> dict[str, Any]:
    return {
        "row_id": item.row_id,
        "source": f"{SOURCE_PREFIX}{item.task}",
        "messages": [
            {"role": "user", "content": item.entry["question"]},
            {"role": "assistant", "content": str(item.entry["answer"])},
        ],
    }


def wrong_answer(item: TaskEntry, rng: random.Random) -> str | None:
    """A wrong answer of the same form as the gold one (a nearby number), confirmed wrong by the task's
    scorer; None when the gold answer is not a number or no candidate is scored wrong."""
    gold = str(item.entry["answer"]).strip()
    if final_number(gold) != gold:
        return None
    value = float(gold)
    is_integer = "." not in gold
    offsets = [1, -1, 2, -2, 10, -10, 3, -3]
    rng.shuffle(offsets)
    for offset in offsets:
        candidate = value + offset if is_integer else value + offset * 10 ** -len(gold.split(".")[1])
        text = str(int(candidate)) if is_integer else f"{candidate:.{len(gold.split('.')[1])}f}"
        if text != gold and score(item.task, text, item.entry) <= WRONG_SCORE_MAX:
            return text
    return None


def comparison_row(item: TaskEntry, rng: random.Random) -> dict[str, Any] | None:
    """chosen = verified gold answer, rejected = checked-wrong answer; None if either check fails."""
    gold = str(item.entry["answer"])
    if score(item.task, gold, item.entry) != 1.0:
        return None
    wrong = wrong_answer(item, rng)
    if wrong is None:
        return None
    return {
        "row_id": item.row_id,
        "source": f"{SOURCE_PREFIX}{item.task}",
        "prompt": [{"role": "user", "content": item.entry["question"]}],
        "chosen": [{"role": "assistant", "content": gold}],
        "rejected": [{"role": "assistant", "content": wrong}],
    }
