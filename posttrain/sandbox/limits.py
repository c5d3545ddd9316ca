"""Resource limits of one sandboxed run, and how the sandbox is chosen (bubblewrap or rlimit-only)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

ALLOW_UNSANDBOXED_ENV = "POSTTRAIN_SANDBOX_ALLOW_RLIMIT_ONLY"
"""Set to 1 to run candidate code with rlimits alone where bubblewrap is missing (warns on every run)."""


@dataclass(frozen=True)
class Limits:
    """Per-run limits. `cpu_seconds` defaults to the wall-clock timeout rounded up plus one second, so a
    busy loop is stopped by the CPU limit even if the host is slow to notice the deadline. Limits apply
    per process inside the sandbox, except `processes` (per sandbox under bubblewrap's user namespace)."""

    timeout_s: float = 10.0
    memory_mb: int = 512
    cpu_seconds: int | None = None
    processes: int = 32
    file_size_mb: int = 16
    open_files: int = 64
    tmp_size_mb: int = 64
    max_output_bytes: int = 1 << 20
    tail_chars: int = 4000

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.memory_mb < 32:
            raise ValueError(
                f"Limits(timeout_s={self.timeout_s}, memory_mb={self.memory_mb}): timeout_s must be > 0 and "
                "memory_mb >= 32 (the Python interpreter alone needs ~20 MB of address space)"
            )

    def harness_limits(self) -> dict[str, int]:
        cpu = self.cpu_seconds if self.cpu_seconds is not None else math.ceil(self.timeout_s) + 1
        return {
            "memory_mb": self.memory_mb,
            "cpu_seconds": cpu,
            "processes": self.processes,
            "file_size_mb": self.file_size_mb,
            "open_files": self.open_files,
        }


def rlimit_only_allowed(allow_rlimit_only: bool | None) -> bool:
    """The explicit parameter wins; otherwise the environment variable opts in."""
    if allow_rlimit_only is not None:
        return allow_rlimit_only
    return os.environ.get(ALLOW_UNSANDBOXED_ENV, "").strip().lower() in ("1", "true", "yes")
