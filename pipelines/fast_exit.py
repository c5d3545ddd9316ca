"""Run processes skip the interpreter's garbage collection at exit.

Python's finalization runs full cyclic collections over every object still alive, and a Dagster run
process holds a lot of them (Dagster, MLflow, SQLAlchemy, transformers and torch modules), so a run
process spent seconds between RUN_SUCCESS and its exit, all in ``gc_collect_main``
(bench/bench_dagster_overhead.py; docs/benchmarks.md). Those
collections free nothing that matters: the process is ending and the OS takes its memory back.

So an exit handler moves every live object into the collector's permanent generation
(``gc.freeze()``), which finalization's collections skip. It is registered when ``pipelines`` is
imported, before MLflow, the tinker SDK or logging's late handlers, and exit handlers run last-in
first-out: theirs (MLflow's flush, temporary directories' cleanup, stopping the embedded server) still
run first. Objects are still released by reference count as modules are torn down; only garbage
caught in reference cycles is left to the OS.
"""

from __future__ import annotations

import atexit
import gc


def register() -> None:
    """Installs the exit handler (``pipelines/__init__.py`` calls this once per process)."""
    atexit.register(gc.freeze)
