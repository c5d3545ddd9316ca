"""Helpers shared by the sandbox tests: a process census (nothing a run starts may survive it)."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from posttrain.sandbox import run_tests


def processes_matching(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if marker in " ".join(process.info["cmdline"] or []):
            found.append(process)
    return found


def descendants() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def assert_nothing_survives(marker: str, before: set[int]) -> None:
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and (processes_matching(marker) or descendants() - before):
        time.sleep(0.05)
    assert processes_matching(marker) == []
    assert descendants() - before == set()


def assert_next_run_works() -> None:
    result = run_tests("def add_three(x):\n    return x + 3\n", "assert add_three(1) == 4\n", timeout_s=10, memory_mb=256)
    assert result.status == "passed", result


def kill_all(marker: str) -> None:
    for process in processes_matching(marker):
        try:
            os.kill(process.pid, 9)
        except ProcessLookupError:
            pass


@pytest.fixture
def without_bwrap(monkeypatch):
    """A host where bubblewrap is missing (the contrast: what rlimits alone let through)."""
    monkeypatch.setenv("POSTTRAIN_SANDBOX_BWRAP", "/nonexistent/bwrap")
