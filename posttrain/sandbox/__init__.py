"""Run untrusted Python (model-written programs) with their tests under bubblewrap, with rlimits, a
wall-clock timeout and a bounded worker pool. See README "Recipes" (code RL) for guarantees and limits."""

from posttrain.sandbox.isolation import SandboxUnavailableError
from posttrain.sandbox.limits import ALLOW_UNSANDBOXED_ENV, Limits
from posttrain.sandbox.pool import SandboxPool, default_pool
from posttrain.sandbox.result import STATUSES, ExecutionResult, Status
from posttrain.sandbox.runner import StdinCase, run_python, run_stdin_tests, run_tests
from posttrain.sandbox.suite import ProblemTests

__all__ = [
    "ALLOW_UNSANDBOXED_ENV",
    "STATUSES",
    "ExecutionResult",
    "Limits",
    "ProblemTests",
    "SandboxPool",
    "SandboxUnavailableError",
    "Status",
    "StdinCase",
    "default_pool",
    "run_python",
    "run_stdin_tests",
    "run_tests",
]
