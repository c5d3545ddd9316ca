"""The harness as each sandbox gets it: bytecode compiled once per interpreter, not source.

Every sandboxed run starts a fresh interpreter on the harness, which would otherwise compile the
harness's source each time (``-B``: nothing may be cached inside the sandbox), a noticeable share of a
short run (bench/bench_sandbox.py). The bytecode is made by the interpreter that will run it (any version may be
configured as the sandbox's), in a child process given only our own trusted source, and kept in memory
for the life of this process; should that fail, runs get the source as before.
"""

from __future__ import annotations

import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

HARNESS_SOURCE = (Path(__file__).parent / "harness_script.py").read_text(encoding="utf-8")
COMPILE_TIMEOUT_S = 30.0

# Run by the sandbox interpreter: our source on stdin, a .pyc image on stdout. ``python file.pyc``
# checks only the magic number of the 16-byte header, so the rest of it can stay zero.
_COMPILER = (
    "import importlib.util, marshal, sys\n"
    "code = compile(sys.stdin.buffer.read(), sys.argv[1], 'exec')\n"
    "sys.stdout.buffer.write(importlib.util.MAGIC_NUMBER + bytes(12) + marshal.dumps(code))\n"
)


@dataclass(frozen=True)
class HarnessFile:
    """The file a sandbox's interpreter is started on: its name in the run directory and its bytes."""

    name: str
    content: bytes


_compiled: dict[str, HarnessFile] = {}
_lock = threading.Lock()


def harness_file(python: str) -> HarnessFile:
    """The harness for the interpreter ``python``: its bytecode, or the source itself when that
    interpreter cannot compile it."""
    with _lock:
        if python not in _compiled:
            _compiled[python] = _compile(python)
        return _compiled[python]


def _compile(python: str) -> HarnessFile:
    try:
        done = subprocess.run(
            [python, "-I", "-S", "-B", "-c", _COMPILER, "harness.py"],
            input=HARNESS_SOURCE.encode("utf-8"),
            capture_output=True,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            timeout=COMPILE_TIMEOUT_S,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return HarnessFile("harness.py", HARNESS_SOURCE.encode("utf-8"))
    return HarnessFile("harness.pyc", done.stdout)
