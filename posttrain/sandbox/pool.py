"""A bounded pool of sandbox workers: at most `max_workers` sandboxes run at once.

Each run is a child process, so threads are enough to overlap them; the bound keeps a large RL batch
from starting hundreds of interpreters on a small machine.

The default size is one more than the number of cores. A short run spends part of its wall time
asleep in the kernel while bubblewrap builds and tears down its namespaces, and with one worker per core
those moments leave a core idle; one extra worker fills them (bench/bench_sandbox.py; docs/benchmarks.md,
code RL's sandbox). A CPU-bound candidate shares a core
with the extra worker's runs, so its wall time (what ``timeout_s`` bounds) can grow by up to 1/cores.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class SandboxPool:
    """`submit(run_tests, program, tests, timeout_s=...)` returns a Future; `map_calls` runs many and
    returns their results in input order."""

    def __init__(self, max_workers: int | None = None) -> None:
        workers = max_workers if max_workers is not None else default_size()
        if workers < 1:
            raise ValueError(f"SandboxPool(max_workers={max_workers}): need at least one worker")
        self.max_workers = workers
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")

    def submit(self, run: Callable[..., T], /, *args, **kwargs) -> Future[T]:
        return self._executor.submit(run, *args, **kwargs)

    def map_calls(self, calls: Iterable[Callable[[], T]]) -> list[T]:
        futures = [self._executor.submit(call) for call in calls]
        return [future.result() for future in futures]

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def default_size() -> int:
    """Workers of a pool built without ``max_workers``: the cores plus one (module docstring)."""
    return (os.cpu_count() or 1) + 1


_default_pool: SandboxPool | None = None
_default_lock = threading.Lock()


def default_pool() -> SandboxPool:
    """The process-wide pool (``default_size()`` workers), created on first use."""
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            _default_pool = SandboxPool()
        return _default_pool
