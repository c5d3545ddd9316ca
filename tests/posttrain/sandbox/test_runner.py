"""Statuses, the sentinel, stdin cases, the pool and the bubblewrap-missing policy."""

from __future__ import annotations

import time

import pytest

from posttrain.sandbox import (
    STATUSES,
    Limits,
    SandboxPool,
    SandboxUnavailableError,
    StdinCase,
    run_python,
    run_stdin_tests,
    run_tests,
)

FAST = {"timeout_s": 10.0, "memory_mb": 256}


def test_statuses_of_plain_scripts():
    assert run_python("print(input()[::-1])", stdin="abc\n", **FAST).stdout_tail == "cba\n"
    failed = run_python("import sys; print('bye', file=sys.stderr); sys.exit(3)", **FAST)
    assert (failed.status, failed.exit_code, failed.stderr_tail) == ("failed", 3, "bye\n")
    segfault = run_python("import os; os.kill(os.getpid(), 11)", **FAST)
    assert segfault.status == "crashed" and "SIGSEGV" in segfault.reason
    cpu_bound = Limits(timeout_s=60, memory_mb=256, cpu_seconds=1)  # generous wall clock: the machine may be loaded
    cpu = run_python("while True: pass", timeout_s=60, memory_mb=256, limits=cpu_bound)
    assert cpu.status == "timeout" and cpu.reason == "CPU time limit exceeded" and cpu.duration_s < 30
    assert {r.status for r in (failed, segfault, cpu)} <= set(STATUSES)


def test_the_sandbox_is_bubblewrap_with_a_private_tmp():
    first = run_python("open('/tmp/x', 'w').write('1'); import os; print(os.getcwd(), os.listdir('/tmp'))", **FAST)
    assert first.isolation == "bwrap" and first.stdout_tail == "/tmp ['x']\n"
    assert run_python("import os; print(os.listdir('/tmp'))", **FAST).stdout_tail == "[]\n"


def test_tests_must_run_to_the_end():
    program = "def add_three(x):\n    return x + 3\n"
    assert run_tests(program, "assert add_three(1) == 4\n", **FAST).status == "passed"
    assert run_tests(program, "assert add_three(1) == 5\n", **FAST).status == "failed"
    for early_exit in ("import sys; sys.exit(0)\n", "import os; os._exit(0)\n", "raise SystemExit\n"):
        result = run_tests(early_exit + program, "assert add_three(1) == 4\n", **FAST)
        assert result.status == "failed", (early_exit, result)
    forged = run_tests("print('\\nposttrain-sandbox-done-' + '0' * 32)\nimport os; os._exit(0)\n", "assert False\n", **FAST)
    assert forged.status == "failed" and forged.reason == "exited before the tests finished"


def test_stdin_cases():
    cases = [StdinCase("1 2\n", "3\n"), StdinCase("5 7", "12")]
    assert run_stdin_tests("a, b = map(int, input().split())\nprint(a + b)", cases, **FAST).status == "passed"
    wrong = run_stdin_tests("a, b = map(int, input().split())\nprint(a - b)", cases, **FAST)
    assert wrong.status == "failed" and "case 0" in wrong.stderr_tail
    peek = run_stdin_tests("import glob; print(glob.glob('/sandbox/*'))", [StdinCase("", "['/sandbox/harness.pyc', '/sandbox/program.py', '/sandbox/stdin.txt']")], **FAST)
    assert peek.status == "passed"  # the expected outputs are not on the sandbox's disk
    with pytest.raises(ValueError, match="no cases"):
        run_stdin_tests("print(1)", [], **FAST)


def test_pool_bounds_concurrency_and_keeps_order():
    program = "import time, os\ntime.sleep(0.5)\nprint(os.getpid())"
    with SandboxPool(max_workers=2) as pool:
        started = time.monotonic()
        futures = [pool.submit(run_python, program + f"\nprint({i})", **FAST) for i in range(4)]
        results = [f.result() for f in futures]
        elapsed = time.monotonic() - started
    assert [r.stdout_tail.split()[-1] for r in results] == ["0", "1", "2", "3"]
    assert elapsed >= 1.0  # 4 runs of 0.5 s on 2 workers need two rounds
    with pytest.raises(ValueError, match="at least one worker"):
        SandboxPool(max_workers=0)


def test_missing_bubblewrap_refuses_unless_opted_in(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_SANDBOX_BWRAP", "/nonexistent/bwrap")
    monkeypatch.delenv("POSTTRAIN_SANDBOX_ALLOW_RLIMIT_ONLY", raising=False)
    with pytest.raises(SandboxUnavailableError, match="apt-get install bubblewrap"):
        run_python("print(1)", **FAST)
    monkeypatch.setenv("POSTTRAIN_SANDBOX_ALLOW_RLIMIT_ONLY", "1")
    for _ in range(2):  # warns on every run, not once
        with pytest.warns(RuntimeWarning, match="WITHOUT a sandbox"):
            result = run_python("print(1)", **FAST)
        assert (result.status, result.isolation) == ("passed", "rlimit_only")
    with pytest.raises(SandboxUnavailableError):
        run_python("print(1)", allow_rlimit_only=False, **FAST)


def test_a_failure_to_switch_to_nobody_is_a_sandbox_error(monkeypatch, tmp_path):
    """On a root host the switch to nobody goes through setpriv; if it fails the run is a sandbox error
    (the host's fault), not a failed program. The host is made to look like root so that this runs
    anywhere: the fake setpriv fails before anything would need root."""
    import os
    import shutil

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    broken = tmp_path / "setpriv"
    broken.write_text("#!/bin/sh\necho 'setpriv: setresuid failed: Operation not permitted' >&2\nexit 1\n")
    broken.chmod(0o755)
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *args, **kw: str(broken) if name == "setpriv" else which(name, *args, **kw))
    result = run_python("print(1)", **FAST)
    assert result.status == "sandbox_error", result
    assert "setpriv" in result.stderr_tail


def test_default_pool_has_one_worker_more_than_the_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 6)
    with SandboxPool() as pool:
        assert pool.max_workers == 7
