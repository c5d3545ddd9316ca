"""What one sandboxed run produced, in a form a reward function can grade without parsing logs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["passed", "failed", "timeout", "crashed", "sandbox_error"]
STATUSES: tuple[Status, ...] = ("passed", "failed", "timeout", "crashed", "sandbox_error")


@dataclass(frozen=True)
class ExecutionResult:
    """`status`: "passed" (exited 0 and, when tests ran, the harness saw them all finish), "failed"
    (non-zero exit, a failed test, or an exit before the tests finished), "timeout" (wall clock or CPU
    limit), "crashed" (killed by a signal, out of memory, or too much output), "sandbox_error" (the
    sandbox itself could not run; says nothing about the program). Output is kept as bounded tails."""

    status: Status
    reason: str
    exit_code: int | None
    stdout_tail: str
    stderr_tail: str
    duration_s: float
    isolation: str

    @property
    def passed(self) -> bool:
        return self.status == "passed"
