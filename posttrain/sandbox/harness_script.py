"""The program that runs INSIDE the sandbox: it applies the resource limits, then runs the candidate.

It is copied into each sandbox (as bytecode: harness_code.py) and run by the sandbox's own
interpreter, so it imports only the standard library and nothing from posttrain. Its trusted input
(mode, limits, tests, the nonce) arrives marshal-encoded (json and runpy cost tens of ms to import) on
the file descriptor named by argv[1], which it reads and closes before any candidate code runs: the
candidate cannot read the nonce from the pipe, so it cannot forge the "tests finished" sentinel by
exiting early or printing. In "stdin" mode the expected outputs live only in this process, which
makes itself non-dumpable, while each case runs the program in a separate child process.

Exit codes (read by posttrain.sandbox.runner): 0 success, 1 program or test failure, 2 bad harness
input, 3 MemoryError.
"""

import marshal
import posix as os  # what `os` wraps, already loaded: importing `os` is a measurable share of a short run
import resource
import sys

EXIT_FAILED = 1
EXIT_BAD_SPEC = 2
EXIT_MEMORY = 3
_PR_SET_DUMPABLE = 4


def _read_spec(spec_fd: int) -> dict:
    chunks = []
    while chunk := os.read(spec_fd, 1 << 16):
        chunks.append(chunk)
    os.close(spec_fd)
    return marshal.loads(b"".join(chunks))


def _apply_limits(limits: dict) -> None:
    memory = limits["memory_mb"] * 1024 * 1024
    file_size = limits["file_size_mb"] * 1024 * 1024
    # CPU: the soft limit sends SIGXCPU (reported as a timeout); the hard one, a second later, SIGKILL.
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_seconds"], limits["cpu_seconds"] + 1))
    for kind, value in (
        (resource.RLIMIT_AS, memory),
        (resource.RLIMIT_NPROC, limits["processes"]),
        (resource.RLIMIT_FSIZE, file_size),
        (resource.RLIMIT_NOFILE, limits["open_files"]),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(kind, (value, value))


def _make_undumpable() -> None:
    """Non-dumpable: other processes of the same user cannot ptrace us or read /proc/<pid>/mem."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _out_of_memory() -> None:
    os.write(2, b"\nMemoryError: the program exceeded the sandbox's memory limit\n")
    os._exit(EXIT_MEMORY)


def _finish(sentinel: str) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - the candidate may have broken the stream; the sentinel still goes out
            pass
    os.write(1, f"\n{sentinel}\n".encode())
    os._exit(0)


def _exec_or_exit(source: str, filename: str, namespace: dict, what: str) -> None:
    try:
        exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - running it is the point
    except MemoryError:
        _out_of_memory()
    except SystemExit as stop:
        sys.stderr.write(f"\n[harness] {what} called exit({stop.code!r}) before the tests finished\n")
        sys.stderr.flush()
        os._exit(EXIT_FAILED)
    except BaseException:  # noqa: BLE001 - any failure of untrusted code is a failed run
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(EXIT_FAILED)


def _run_script(spec: dict) -> None:
    path = spec["program_path"]
    sys.argv = [path]
    with open(path, encoding="utf-8") as source:
        code = compile(source.read(), path, "exec")
    try:
        exec(code, {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__})  # noqa: S102
    except MemoryError:
        _out_of_memory()


def _run_check(spec: dict) -> None:
    namespace = {"__name__": "candidate", "__builtins__": __builtins__}
    with open(spec["program_path"], encoding="utf-8") as source:
        program = source.read()
    _exec_or_exit(program, "program.py", namespace, "the program")
    _exec_or_exit(spec["test_code"], "tests.py", namespace, "the tests")
    _finish(spec["sentinel"])


def _normalized(text: str) -> list:
    lines = [line.rstrip() for line in text.strip().splitlines()]
    return lines


def _run_stdin_cases(spec: dict) -> None:
    import subprocess  # imported here: it is slow to import and only this mode needs it

    _make_undumpable()
    command = [sys.executable, "-I", "-S", "-B", spec["program_path"]]
    for index, case in enumerate(spec["cases"]):
        try:
            done = subprocess.run(
                command, input=case["input"], capture_output=True, text=True, timeout=spec["case_timeout_s"]
            )
        except subprocess.TimeoutExpired:
            sys.stderr.write(f"[harness] case {index}: time limit exceeded\n")
            os._exit(EXIT_FAILED)
        if done.returncode != 0 or _normalized(done.stdout) != _normalized(case["output"]):
            sys.stderr.write(done.stderr[-2000:])
            sys.stderr.write(
                f"\n[harness] case {index}: exit code {done.returncode}, expected output "
                f"{case['output'][:200]!r}, got {done.stdout[:200]!r}\n"
            )
            os._exit(EXIT_FAILED)
    _finish(spec["sentinel"])


MODES = {"script": _run_script, "check": _run_check, "stdin": _run_stdin_cases}


def main() -> None:
    try:
        spec = _read_spec(int(sys.argv[1]))
        _apply_limits(spec["limits"])
        run = MODES[spec["mode"]]
    except (OSError, ValueError, KeyError, IndexError) as error:
        sys.stderr.write(f"[harness] bad harness input: {error!r}\n")
        os._exit(EXIT_BAD_SPEC)
    run(spec)


if __name__ == "__main__":
    main()
