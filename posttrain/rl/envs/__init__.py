"""RL environments by name: ``build_rl_dataset(env, renderer, ...)`` -> :class:`~posttrain.rl.types.RLDataset`.

Names (``ENV_NAMES``):
- ``arithmetic`` — "What is x + y?", x, y in [0, 100] (generated; ``num_batches`` steps);
- ``guess_number`` — multi-turn higher/lower game (generated; options ``low``, ``high``, ``max_turns``);
- ``problems`` — any ``rl_problems`` table passed as ``table`` (each row graded by its own scorer);
- ``code`` — any ``code_problems`` table passed as ``table``: write a function, graded by its tests in
  the sandbox (``code_env``); option ``timeout_s`` (per sandboxed run);
- ``gsm8k`` — the GSM8K preset through ``posttrain.datasets`` (hub, or its local mirror); option ``limit``;
- ``reasoning_gym:<task>[,<task>...]`` — any reasoning-gym task(s), generated, graded by the task's own
  scorer; options ``limit`` (problems generated, default 200).
Table-backed envs take options ``split`` (default "train"), ``num_epochs`` and ``system``.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from posttrain.completers import ChatRenderer
from posttrain.rl.envs.arithmetic import ArithmeticDataset
from posttrain.rl.envs.code_env import CodeDataset, problems_from_code_table
from posttrain.rl.envs.guess_number import GuessNumberDataset
from posttrain.rl.envs.problem_dataset import ProblemDataset, problems_from_rl_table
from posttrain.rl.envs.problem_env import DEFAULT_FORMAT_COEF
from posttrain.rl.types import RLDataset

REASONING_GYM_PREFIX = "reasoning_gym:"
ENV_NAMES = ("arithmetic", "guess_number", "problems", "code", "gsm8k", "reasoning_gym:<task>[,<task>...]")
TABLE_OPTIONS = frozenset({"split", "num_epochs", "system"})
ENV_OPTIONS: dict[str, frozenset[str]] = {
    "arithmetic": frozenset(),
    "guess_number": frozenset({"low", "high", "max_turns"}),
    "problems": TABLE_OPTIONS,
    "code": TABLE_OPTIONS | {"timeout_s"},
    "gsm8k": TABLE_OPTIONS | {"limit"},
    REASONING_GYM_PREFIX: TABLE_OPTIONS | {"limit"},
}
TABLE_KINDS = {"problems": "an rl_problems table", "code": "a code_problems table"}  # envs that train on a given table
DEFAULT_GENERATED_PROBLEMS = 200


def _family(env: str) -> str:
    return REASONING_GYM_PREFIX if env.startswith(REASONING_GYM_PREFIX) else env


def check_env(env: str, options: dict[str, Any], table: pa.Table | None = None) -> None:
    """Raise a ValueError naming the valid env names / options when ``env`` or ``options`` is wrong."""
    family = _family(env)
    if family not in ENV_OPTIONS:
        raise ValueError(f"unknown RL env {env!r}; valid envs: {', '.join(ENV_NAMES)}")
    unknown = sorted(set(options) - ENV_OPTIONS[family])
    if unknown:
        raise ValueError(f"RL env {env!r} has no options {unknown}; its options: {sorted(ENV_OPTIONS[family]) or 'none'}")
    if family in TABLE_KINDS and table is None:
        raise ValueError(f"RL env {env!r} needs {TABLE_KINDS[family]} (pass table=...)")


def build_rl_dataset(
    env: str,
    renderer: ChatRenderer,
    *,
    group_size: int,
    groups_per_batch: int,
    seed: int = 0,
    num_batches: int = 100,
    format_coef: float = DEFAULT_FORMAT_COEF,
    table: pa.Table | None = None,
    options: dict[str, Any] | None = None,
) -> RLDataset:
    options = dict(options or {})
    check_env(env, options, table)
    sizes = {"group_size": group_size, "groups_per_batch": groups_per_batch, "seed": seed}
    if env == "arithmetic":
        return ArithmeticDataset(renderer, num_batches=num_batches, format_coef=format_coef, **sizes)
    if env == "guess_number":
        return GuessNumberDataset(renderer, num_batches=num_batches, **sizes, **options)
    if env == "code":
        assert table is not None
        problems = problems_from_code_table(table, options.pop("split", "train"))
        return CodeDataset(problems, renderer, format_coef=format_coef, **sizes, **options)
    if env != "problems":
        table = _load_problem_table(env, options.pop("limit", None), seed)
    assert table is not None
    problems = problems_from_rl_table(table, options.pop("split", "train"))
    return ProblemDataset(problems, renderer, format_coef=format_coef, **sizes, **options)


def _load_problem_table(env: str, limit: int | None, seed: int) -> pa.Table:
    from posttrain.datasets.loaders import LoadSpec, load

    if env.startswith(REASONING_GYM_PREFIX):
        limit = limit or DEFAULT_GENERATED_PROBLEMS
    return load(LoadSpec(kind="rl", source=env, limit=limit, seed=seed)).table


__all__ = ["ENV_NAMES", "build_rl_dataset", "check_env"]
