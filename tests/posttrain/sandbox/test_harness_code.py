"""The harness reaches each sandbox as the sandbox interpreter's bytecode, or as source when it cannot be compiled."""

from __future__ import annotations

import subprocess

from posttrain.sandbox import run_tests
from posttrain.sandbox.harness_code import HARNESS_SOURCE, harness_file
from posttrain.sandbox.isolation import sandbox_python


def test_the_harness_is_bytecode_of_the_sandbox_interpreter():
    python = sandbox_python()
    harness = harness_file(python)
    assert harness.name == "harness.pyc"
    magic = subprocess.run([python, "-I", "-S", "-c", "import importlib.util, sys; sys.stdout.buffer.write(importlib.util.MAGIC_NUMBER)"],
                           capture_output=True, check=True).stdout
    assert harness.content[:4] == magic
    assert harness_file(python) is harness  # compiled once per interpreter
    result = run_tests("def add_three(x):\n    return x + 3\n", "assert add_three(1) == 4\n", timeout_s=10, memory_mb=256)
    assert result.status == "passed", result


def test_an_interpreter_that_cannot_compile_gets_the_source(tmp_path):
    broken = tmp_path / "python3"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    harness = harness_file(str(broken))
    assert harness.name == "harness.py" and harness.content == HARNESS_SOURCE.encode()
    assert harness_file(str(tmp_path / "missing")).name == "harness.py"
