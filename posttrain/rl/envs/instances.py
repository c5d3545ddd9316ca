"""RL env instances as rows of an ``rl_problems`` table: an env is a row schema plus a reward function.

A recipe trains only on materialized tables, so a generated env first writes its instances as rows
(``RL_PROBLEMS`` schema) and the env reads them back:

- ``arithmetic?count=N&seed=S`` — "What is x + y?", x, y in [0, 100], distinct pairs; graded by value
  (``exact_number``);
- ``guess_number?count=N&seed=S&low=1&high=100&max_turns=7`` — one secret per row (``answer``), the
  range and turn budget in ``scorer_metadata``; a multi-turn game (``posttrain.rl.envs.guess_number``).

Any other row (reasoning-gym tasks, GSM8K, a user's question/answer file) is a single-turn problem
graded by its own scorer. :func:`group_builder` turns one row into the group of envs that plays it.

Held-out membership is the usual hash of the row's prompt; a guess-the-number game shows every player
the same instructions, so its "prompt" for splitting is the instance (instructions + secret).
"""

from __future__ import annotations

import json
import random
from typing import Any

from posttrain.completers import ChatRenderer
from posttrain.datasets.problems import RLProblem
from posttrain.datasets.splits import assign_splits
from posttrain.rl.envs.arithmetic import MAX_OPERAND
from posttrain.rl.envs.guess_number import GuessNumberGroupBuilder, instructions
from posttrain.rl.envs.problem_env import DEFAULT_FORMAT_COEF, ProblemGroupBuilder
from posttrain.rl.types import EnvGroupBuilder

GUESS_NUMBER_SCORER = "env:guess_number"  # multi-turn: graded by playing the game, not by comparing an answer
MULTI_TURN_SCORERS = frozenset({GUESS_NUMBER_SCORER})
GENERATORS = ("arithmetic", "guess_number")
_OPTIONS = {"arithmetic": {"count", "seed"}, "guess_number": {"count", "seed", "low", "high", "max_turns"}}
DEFAULT_COUNT = 400


def is_generated(source: str) -> bool:
    return source.partition("?")[0] in GENERATORS


def parse_source(source: str) -> tuple[str, dict[str, int]]:
    """``"guess_number?count=200&high=50"`` -> ("guess_number", {"count": 200, "high": 50}); says what is wrong."""
    name, _, query = source.partition("?")
    if name not in GENERATORS:
        raise ValueError(f"{source!r} is not a generated env; generated envs: {', '.join(GENERATORS)}")
    options: dict[str, int] = {}
    for part in filter(None, query.split("&")):
        key, sep, value = part.partition("=")
        if not sep or key not in _OPTIONS[name]:
            raise ValueError(f"{source!r}: option {part!r} is not one of {sorted(_OPTIONS[name])} as key=<integer>")
        try:
            options[key] = int(value)
        except ValueError as error:
            raise ValueError(f"{source!r}: option {key}={value!r} must be an integer") from error
    return name, options


def generate_rows(source: str, heldout_fraction: float, default_count: int | None = None) -> list[dict[str, Any]]:
    """The instances ``source`` names, as ``RL_PROBLEMS`` rows with their split (``count`` defaults to ``default_count``)."""
    name, options = parse_source(source)
    count, seed = options.pop("count", default_count or DEFAULT_COUNT), options.pop("seed", 0)
    if count < 1:
        raise ValueError(f"{source!r}: count must be >= 1, got {count}")
    if name == "arithmetic":
        rows, split_keys = _arithmetic(count, seed)
    else:
        rows, split_keys = _guess_number(count, seed, **options)
    for row, split in zip(rows, assign_splits(split_keys, heldout_fraction), strict=True):
        row["split"] = split
    return rows


def _arithmetic(count: int, seed: int) -> tuple[list[dict[str, Any]], list[str]]:
    combinations = (MAX_OPERAND + 1) ** 2
    if count > combinations:
        raise ValueError(f"arithmetic: count={count} exceeds the {combinations} distinct x + y problems")
    pairs = [divmod(index, MAX_OPERAND + 1) for index in random.Random(f"arithmetic:{seed}").sample(range(combinations), count)]
    rows = [
        {"row_id": f"arithmetic/{x}+{y}", "source": "arithmetic", "task": "arithmetic", "question": f"What is {x} + {y}?",
         "answer": str(x + y), "scorer": "exact_number", "scorer_metadata": "{}"}
        for x, y in pairs
    ]
    return rows, [row["question"] for row in rows]


def _guess_number(count: int, seed: int, low: int = 1, high: int = 100, max_turns: int = 7) -> tuple[list[dict[str, Any]], list[str]]:
    if low > high or max_turns < 1:
        raise ValueError(f"guess_number: need low ({low}) <= high ({high}) and max_turns ({max_turns}) >= 1")
    rng = random.Random(f"guess_number:{seed}")
    question = instructions(low, high, max_turns)
    metadata = json.dumps({"low": low, "high": high, "max_turns": max_turns}, sort_keys=True)
    rows = [
        {"row_id": f"guess_number/seed{seed}/{index}", "source": "guess_number", "task": "guess_number", "question": question,
         "answer": str(rng.randint(low, high)), "scorer": GUESS_NUMBER_SCORER, "scorer_metadata": metadata}
        for index in range(count)
    ]
    return rows, [f"{question}\nsecret={row['answer']}" for row in rows]


def unplayable(problem: RLProblem) -> str | None:
    """Why a multi-turn instance row cannot be played (bad secret or settings), or None."""
    if problem.scorer not in MULTI_TURN_SCORERS:
        return None
    try:
        group_builder(problem, renderer=None, group_size=1).make_envs()  # type: ignore[arg-type]  # envs only store it
    except (ValueError, TypeError) as error:
        return f"{problem.row_id}: {problem.scorer} instance is not playable: {error}"
    return None


def group_builder(
    problem: RLProblem,
    renderer: ChatRenderer,
    group_size: int,
    *,
    format_coef: float = DEFAULT_FORMAT_COEF,
    system: str | None = None,
) -> EnvGroupBuilder:
    """The group of envs that plays one row: its multi-turn game, or a single-turn problem graded by its scorer."""
    if problem.scorer == GUESS_NUMBER_SCORER:
        settings = json.loads(problem.scorer_metadata or "{}")
        return GuessNumberGroupBuilder(renderer, int(problem.answer), group_size, **settings)
    return ProblemGroupBuilder(renderer, problem, group_size, format_coef, system)
