"""A process that imports `pipelines` freezes its objects at exit, after every exit handler registered later."""

from __future__ import annotations

import subprocess
import sys


def test_exit_handlers_registered_later_run_first_then_the_objects_are_frozen():
    program = (
        "import atexit, gc\n"
        "atexit.register(lambda: print('registered before pipelines: frozen', gc.get_freeze_count() > 0))\n"
        "import pipelines\n"
        "atexit.register(lambda: print('registered after pipelines: frozen', gc.get_freeze_count() > 0))\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.splitlines() == [
        "registered after pipelines: frozen False",  # e.g. MLflow's flush, the embedded server's stop
        "registered before pipelines: frozen True",
    ]
