"""Run candidate code once in the sandbox and classify the outcome.

The harness (harness_script.py) runs inside; this side writes its files to a fresh directory, sends the
trusted spec through a pipe, enforces the wall-clock deadline and the output cap, kills the whole
process group when either is hit, and turns exit code + sentinel into an ExecutionResult.
"""

from __future__ import annotations

import marshal
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from posttrain.sandbox.harness_code import harness_file
from posttrain.sandbox.isolation import CLEAN_ENV, NOBODY, Launch, choose_isolation, launch_for, sandbox_python
from posttrain.sandbox.limits import Limits
from posttrain.sandbox.result import ExecutionResult, Status

EXIT_MEMORY = 3
BAD_SPEC_MARKER = b"[harness] bad harness input"
POLL_INTERVAL_S = 0.05
PIPE_BUFFER_BYTES = 65536  # Linux default; a larger spec is written from a thread
MARSHAL_VERSION = 4  # readable by every Python 3 the sandbox may run
EXIT_GRACE_S = 0.2
SIGNAL_EXIT_BASE = 128  # bubblewrap reports a child killed by signal N as exit code 128 + N


@dataclass(frozen=True)
class StdinCase:
    """One input/output test: the program gets `input` on stdin and must print `output` (compared line
    by line, trailing whitespace and blank edges ignored)."""

    input: str
    output: str


def run_python(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float,
    memory_mb: int,
    limits: Limits | None = None,
    allow_rlimit_only: bool | None = None,
) -> ExecutionResult:
    """Run `code` as a script; "passed" means it exited 0."""
    limits = _limits(limits, timeout_s, memory_mb)
    return _run(code, {"mode": "script"}, stdin, limits, allow_rlimit_only, expects_sentinel=False)


def run_tests(
    program: str,
    tests: str,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    limits: Limits | None = None,
    allow_rlimit_only: bool | None = None,
) -> ExecutionResult:
    """Run `program`, then the Python test code `tests` in the same namespace (asserts, or HumanEval's
    `check(candidate)` followed by `check(<entry_point>)`). "passed" only if the harness saw the tests
    run to the end: an early exit(0) of the program is "failed"."""
    limits = _limits(limits, timeout_s, memory_mb)
    return _run(program, {"mode": "check", "test_code": tests}, "", limits, allow_rlimit_only, expects_sentinel=True)


def run_stdin_tests(
    program: str,
    cases: Sequence[StdinCase],
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    limits: Limits | None = None,
    allow_rlimit_only: bool | None = None,
) -> ExecutionResult:
    """Run `program` once per case with the case's input on stdin; "passed" if every output matches.
    `timeout_s` bounds the whole run; each case gets the same bound."""
    if not cases:
        raise ValueError("run_stdin_tests: no cases given; a program cannot pass an empty test suite")
    limits = _limits(limits, timeout_s, memory_mb)
    spec = {
        "mode": "stdin",
        "cases": [{"input": case.input, "output": case.output} for case in cases],
        "case_timeout_s": limits.timeout_s,
    }
    return _run(program, spec, "", limits, allow_rlimit_only, expects_sentinel=True)


def _limits(limits: Limits | None, timeout_s: float, memory_mb: int) -> Limits:
    if limits is None:
        return Limits(timeout_s=timeout_s, memory_mb=memory_mb)
    return limits


def _run(
    program: str, spec: dict, stdin: str, limits: Limits, allow_rlimit_only: bool | None, *, expects_sentinel: bool
) -> ExecutionResult:
    isolation = choose_isolation(allow_rlimit_only)
    host_dir = Path(tempfile.mkdtemp(prefix="posttrain-sandbox-"))
    spec_read, spec_write = os.pipe()
    try:
        harness = harness_file(sandbox_python())
        _write_bytes(host_dir / harness.name, harness.content)
        _write(host_dir / "program.py", program)
        _write(host_dir / "stdin.txt", stdin)
        host_dir.chmod(0o755)  # bubblewrap may run as `nobody` and must read these files
        launch = launch_for(isolation, host_dir, spec_read, limits, harness.name)
        sentinel = f"posttrain-sandbox-done-{secrets.token_hex(16)}"
        spec = {**spec, "limits": limits.harness_limits(), "program_path": launch.program_path, "sentinel": sentinel}
        started = time.monotonic()
        process = _start(launch, host_dir / "stdin.txt", spec_read)
        os.close(spec_read)
        spec_read = -1
        if isinstance(process, OSError):
            os.close(spec_write)
            return _result("sandbox_error", f"could not start the sandbox: {process}", None, b"", b"", started, launch, limits)
        payload = marshal.dumps(spec, MARSHAL_VERSION)
        if len(payload) <= PIPE_BUFFER_BYTES:
            _send_spec(spec_write, payload)  # fits the pipe: no thread needed
        else:
            threading.Thread(target=_send_spec, args=(spec_write, payload), daemon=True).start()
        stdout, stderr, stop_reason = _collect(process, started + limits.timeout_s, limits.max_output_bytes)
        expected = sentinel if expects_sentinel else None
        return _classify(process.returncode, stdout, stderr, stop_reason, expected, started, launch, limits)
    finally:
        if spec_read >= 0:
            os.close(spec_read)
        shutil.rmtree(host_dir, ignore_errors=True)


def _write(path: Path, text: str) -> None:
    _write_bytes(path, text.encode("utf-8"))


def _write_bytes(path: Path, content: bytes) -> None:
    path.write_bytes(content)
    path.chmod(0o644)


def _start(launch: Launch, stdin_path: Path, spec_fd: int) -> subprocess.Popen | OSError:
    drop = launch.run_as_nobody
    with open(stdin_path, "rb") as stdin:
        try:
            return subprocess.Popen(
                launch.argv,
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=launch.cwd,
                env=dict(CLEAN_ENV),
                start_new_session=True,  # its own process group, killed as a whole
                pass_fds=(spec_fd,),
                user=NOBODY if drop else None,
                group=NOBODY if drop else None,
                extra_groups=[] if drop else None,
            )
        except OSError as error:
            return error


def _send_spec(fd: int, payload: bytes) -> None:
    """Written from a thread: a spec larger than the pipe buffer would otherwise block before the
    harness starts reading."""
    try:
        with os.fdopen(fd, "wb") as pipe:
            pipe.write(payload)
    except OSError:
        pass  # the sandbox died before reading its spec; the exit code tells the story


def _collect(process: subprocess.Popen, deadline: float, max_output_bytes: int) -> tuple[bytes, bytes, str | None]:
    """Read both pipes until they close, the deadline passes or the output cap is hit; then make sure no
    process of the group survives. Returns (stdout, stderr, why it was stopped or None)."""
    buffers = {process.stdout: bytearray(), process.stderr: bytearray()}
    total = 0
    stop_reason = None
    exited_at = None
    with selectors.DefaultSelector() as selector:
        for stream in buffers:
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map() and stop_reason is None:
            now = time.monotonic()
            if now >= deadline:
                stop_reason = "timeout"
                break
            if exited_at is None and process.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > EXIT_GRACE_S:
                break  # a leftover background process holds the pipes open; it is killed below
            for key, _ in selector.select(timeout=min(deadline - now, POLL_INTERVAL_S)):
                chunk = os.read(key.fileobj.fileno(), 1 << 16)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffers[key.fileobj] += chunk
                total += len(chunk)
                if total > max_output_bytes:
                    stop_reason = "output"
                    break
    if stop_reason is None:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop_reason = "timeout"
    _kill_group(process)
    for stream in buffers:
        stream.close()
    return bytes(buffers[process.stdout]), bytes(buffers[process.stderr]), stop_reason


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _classify(
    code: int | None,
    stdout: bytes,
    stderr: bytes,
    stop_reason: str | None,
    sentinel: str | None,
    started: float,
    launch: Launch,
    limits: Limits,
) -> ExecutionResult:
    if stop_reason == "timeout":
        return _result("timeout", f"wall-clock limit of {limits.timeout_s:g} s exceeded", code, stdout, stderr, started, launch, limits)
    if stop_reason == "output":
        return _result("crashed", f"output exceeded {limits.max_output_bytes} bytes", code, stdout, stderr, started, launch, limits)
    signal_number = _signal_of(code, launch)
    if signal_number is not None:
        if signal_number == signal.SIGXCPU:
            return _result("timeout", "CPU time limit exceeded", code, stdout, stderr, started, launch, limits)
        return _result("crashed", f"killed by {_signal_name(signal_number)}", code, stdout, stderr, started, launch, limits)
    # In script mode (no sentinel) the exit code is the program's own, so only markers in stderr count.
    if (code == EXIT_MEMORY and sentinel is not None) or _ends_with_memory_error(stderr):
        return _result("crashed", f"out of memory (limit {limits.memory_mb} MB)", code, stdout, stderr, started, launch, limits)
    if code != 0 and (stderr.startswith((b"bwrap:", b"setpriv:")) or BAD_SPEC_MARKER in stderr):
        return _result("sandbox_error", "the sandbox failed to start the program", code, stdout, stderr, started, launch, limits)
    if code != 0:
        return _result("failed", f"exited with code {code}", code, stdout, stderr, started, launch, limits)
    if sentinel is not None:
        marker = f"\n{sentinel}\n".encode()
        if not stdout.endswith(marker):
            return _result("failed", "exited before the tests finished", code, stdout, stderr, started, launch, limits)
        stdout = stdout[: -len(marker)]
    return _result("passed", "all tests passed" if sentinel else "exited with code 0", code, stdout, stderr, started, launch, limits)


def _ends_with_memory_error(stderr: bytes) -> bool:
    lines = stderr.rstrip().splitlines()
    return bool(lines) and lines[-1].startswith(b"MemoryError")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _signal_of(code: int | None, launch: Launch) -> int | None:
    if code is None:
        return None
    if code < 0:
        return -code
    if launch.isolation == "bwrap" and code > SIGNAL_EXIT_BASE:
        return code - SIGNAL_EXIT_BASE
    return None


def _result(
    status: Status, reason: str, code: int | None, stdout: bytes, stderr: bytes, started: float, launch: Launch, limits: Limits
) -> ExecutionResult:
    return ExecutionResult(
        status=status,
        reason=reason,
        exit_code=code,
        stdout_tail=stdout.decode("utf-8", "replace")[-limits.tail_chars :],
        stderr_tail=stderr.decode("utf-8", "replace")[-limits.tail_chars :],
        duration_s=time.monotonic() - started,
        isolation=launch.isolation,
    )
