"""The code-RL reward (cookbook semantics): 0.1·(has_code_block − 1) + all_tests_pass.

A response without a fenced code block scores −0.1, a block that fails its tests 0, a block that
passes every test 1. The program is the LAST fenced block (```python or bare ```), so a model may
think in earlier blocks. Grading runs in the sandbox through the bounded pool, so many rollouts can
be graded at once without oversubscribing the machine.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from posttrain.sandbox import ExecutionResult, Limits, ProblemTests, SandboxPool, default_pool

FORMAT_COEF = 0.1
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_CODE_LANGUAGES = {"", "python", "python3", "py"}
NO_CODE_STATUS = "no_code_block"


@dataclass(frozen=True)
class CodeGrade:
    """`status` is the sandbox status, or "no_code_block" when nothing was run."""

    reward: float
    status: str
    has_code_block: bool
    stdout_tail: str = ""
    stderr_tail: str = ""

    @property
    def all_tests_pass(self) -> bool:
        return self.status == "passed"


def extract_program(text: str) -> str | None:
    """The body of the last fenced code block tagged python/py or untagged; None if there is none."""
    blocks = [body for language, body in _FENCE.findall(text) if language.lower() in _CODE_LANGUAGES]
    return blocks[-1] if blocks else None


def reward_for(has_code_block: bool, all_tests_pass: bool, format_coef: float = FORMAT_COEF) -> float:
    return format_coef * (float(has_code_block) - 1.0) + float(all_tests_pass)


def code_reward(
    response_text: str,
    problem_tests: ProblemTests | Mapping[str, Any],
    *,
    limits: Limits | None = None,
    pool: SandboxPool | None = None,
    format_coef: float = FORMAT_COEF,
    allow_rlimit_only: bool | None = None,
) -> CodeGrade:
    """Grade one response against a problem's tests (a ProblemTests, or a CODE_PROBLEMS row)."""
    return submit_code_reward(
        response_text, problem_tests, limits=limits, pool=pool, format_coef=format_coef, allow_rlimit_only=allow_rlimit_only
    ).result()


def code_rewards(
    responses: Sequence[str],
    problem_tests: Sequence[ProblemTests | Mapping[str, Any]],
    *,
    limits: Limits | None = None,
    pool: SandboxPool | None = None,
    format_coef: float = FORMAT_COEF,
    allow_rlimit_only: bool | None = None,
) -> list[CodeGrade]:
    """Grade many (response, tests) pairs concurrently through the pool; results in input order."""
    if len(responses) != len(problem_tests):
        raise ValueError(f"code_rewards: {len(responses)} responses but {len(problem_tests)} test suites")
    futures = [
        submit_code_reward(text, tests, limits=limits, pool=pool, format_coef=format_coef, allow_rlimit_only=allow_rlimit_only)
        for text, tests in zip(responses, problem_tests, strict=True)
    ]
    return [future.result() for future in futures]


def submit_code_reward(
    response_text: str,
    problem_tests: ProblemTests | Mapping[str, Any],
    *,
    limits: Limits | None = None,
    pool: SandboxPool | None = None,
    format_coef: float = FORMAT_COEF,
    allow_rlimit_only: bool | None = None,
) -> Future[CodeGrade]:
    """Start grading in the pool and return a Future (for rollouts that overlap grading with sampling)."""
    tests = problem_tests if isinstance(problem_tests, ProblemTests) else ProblemTests.from_row(problem_tests)
    program = extract_program(response_text)
    if program is None:
        done: Future[CodeGrade] = Future()
        done.set_result(CodeGrade(reward_for(False, False, format_coef), NO_CODE_STATUS, False))
        return done
    run_limits = limits or Limits()
    return (pool or default_pool()).submit(_grade, program, tests, run_limits, format_coef, allow_rlimit_only)


def _grade(program: str, tests: ProblemTests, limits: Limits, format_coef: float, allow_rlimit_only: bool | None) -> CodeGrade:
    result: ExecutionResult = tests.run(program, limits, allow_rlimit_only=allow_rlimit_only)
    return CodeGrade(
        reward=reward_for(True, result.passed, format_coef),
        status=result.status,
        has_code_block=True,
        stdout_tail=result.stdout_tail,
        stderr_tail=result.stderr_tail,
    )
