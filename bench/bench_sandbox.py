"""Sandbox throughput and overhead.

1. Sandboxed test runs per second through SandboxPool (one worker per core) vs one at a time.
   Goal: pool >= 1.8x sequential on 2 cores.
2. Overhead per run: run_python(program) vs a bare `subprocess.run([python, -c, program])` of the same
   program with the same interpreter. Goal: <= 30 ms per run.

Run: .venv/bin/python bench/bench_sandbox.py [--runs 200]. Figures depend on machine load; say so when
quoting them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

from posttrain.sandbox import SandboxPool, run_python, run_tests
from posttrain.sandbox.isolation import sandbox_python

PROGRAM = "def add_three(x):\n    return x + 3\n"
TESTS = "for i in range(100):\n    assert add_three(i) == i + 3\n"
LIMITS = {"timeout_s": 30.0, "memory_mb": 256}


def sequential(runs: int) -> float:
    started = time.perf_counter()
    for _ in range(runs):
        assert run_tests(PROGRAM, TESTS, **LIMITS).passed
    return runs / (time.perf_counter() - started)


def pooled(runs: int, workers: int) -> float:
    with SandboxPool(max_workers=workers) as pool:
        started = time.perf_counter()
        futures = [pool.submit(run_tests, PROGRAM, TESTS, **LIMITS) for _ in range(runs)]
        assert all(f.result().passed for f in futures)
        return runs / (time.perf_counter() - started)


def overhead_ms(runs: int) -> tuple[float, float]:
    """Median wall time of a bare run and of a sandboxed run of the same script, interleaved so load
    drifts affect both alike."""
    python = sandbox_python()
    code = PROGRAM + TESTS
    bare, sandboxed = [], []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([python, "-I", "-S", "-B", "-c", code], check=True, capture_output=True)
        bare.append(time.perf_counter() - started)
        started = time.perf_counter()
        assert run_python(code, **LIMITS).passed
        sandboxed.append(time.perf_counter() - started)
    return statistics.median(bare) * 1000, statistics.median(sandboxed) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)  # the pool's ramp-up blurs fewer runs
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"cores={os.cpu_count()} workers={args.workers} runs={args.runs} load average (1 min) at start={load:.1f}")
    seq = sequential(args.runs)
    pool = pooled(args.runs, args.workers)
    print(f"sequential: {seq:.1f} runs/s   pool: {pool:.1f} runs/s   pool/sequential = {pool / seq:.2f}x (goal >= 1.8x)")
    bare, sandboxed = overhead_ms(args.runs)
    print(f"bare subprocess: {bare:.1f} ms   sandboxed: {sandboxed:.1f} ms   overhead = {sandboxed - bare:.1f} ms/run "
          f"(goal <= 30 ms), ratio {sandboxed / bare:.2f}x")
    print(f"load average (1 min) at end={os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
