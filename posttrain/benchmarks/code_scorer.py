"""HumanEval graded in our bubblewrap sandbox (``posttrain.sandbox.run_tests``) instead of inspect's Docker.

The program is the problem's prompt (signature + docstring) followed by the function body found in the
answer (inspect_evals' own ``find_code``, so grading matches the published task), and the tests are
HumanEval's ``check(candidate)`` then ``check(<entry point>)``. A sample is correct only when the
sandbox reports ``passed`` (the tests ran to the end); timeouts, crashes and sandbox errors are wrong,
and the status is kept in the score's metadata.
"""

from __future__ import annotations

import asyncio

from inspect_ai.scorer import CORRECT, INCORRECT, Score, Scorer, Target, accuracy, scorer, stderr
from inspect_ai.solver import TaskState

from posttrain.sandbox import run_tests

TIMEOUT_S = 10.0
MEMORY_MB = 512


def humaneval_program(prompt: str, completion: str) -> str:
    from inspect_evals.humaneval.humaneval import find_code

    return prompt + find_code(completion)


def humaneval_tests(test: str, entry_point: str) -> str:
    return f"{test}\n\ncheck({entry_point})\n"


@scorer(metrics=[accuracy(), stderr()])
def sandbox_verify(timeout_s: float = TIMEOUT_S, memory_mb: int = MEMORY_MB) -> Scorer:
    """Runs each answer with HumanEval's tests under bubblewrap (in a worker thread: it blocks)."""

    async def score(state: TaskState, target: Target) -> Score:
        program = humaneval_program(state.metadata["prompt"], state.output.completion)
        tests = humaneval_tests(state.metadata["test"], state.metadata["entry_point"])
        result = await asyncio.to_thread(run_tests, program, tests, timeout_s=timeout_s, memory_mb=memory_mb)
        passed = result.passed
        return Score(
            value=CORRECT if passed else INCORRECT,
            answer=program,
            explanation=None if passed else f"{result.status}: {result.reason}\n{result.stderr_tail[-1000:]}",
            metadata={"sandbox_status": result.status},
        )

    return score
