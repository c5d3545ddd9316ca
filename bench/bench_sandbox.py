"""Sandbox throughput and overhead.

1. Sandboxed test runs per second through SandboxPool (its default size: the cores plus one, see
   posttrain/sandbox/pool.py) vs one at a time, in alternating rounds (the best of each side counts).
   Goal: pool >= 1.8x sequential on 2 cores.
2. Overhead per run: run_python(program) vs a bare `subprocess.run([python, -c, program])` of the same
   program with the same interpreter. Goal: <= 30 ms per run.
3. The same overhead from a parent holding a model-sized heap (``--resident-gb``, default 2.6: SmolLM2-135M
   with its optimizer and buffers), as a code-RL run that embeds localtinker starts every test run. A child
   that changes user ids cannot be started with vfork, so it would copy the parent's page tables: before
   the switch to nobody moved into ``setpriv`` (posttrain/sandbox/isolation.py) a run took ~105 ms here
   against ~16 ms. Goal: <= 30 ms per run here too.

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
from posttrain.sandbox.pool import default_size

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
    parser.add_argument("--workers", type=int, default=default_size(), help="pool size (default: the pool's own)")
    parser.add_argument("--rounds", type=int, default=2, help="sequential/pool rounds, alternating; each side's best counts")
    parser.add_argument("--resident-gb", type=float, default=2.6, help="heap the parent holds for part 3 (0 skips it)")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"cores={os.cpu_count()} workers={args.workers} runs={args.runs} rounds={args.rounds} load average (1 min) at start={load:.1f}")
    seq = pool = 0.0
    for _ in range(args.rounds):  # alternating, the best round of each counts: load drifts hit both alike
        seq = max(seq, sequential(args.runs))
        pool = max(pool, pooled(args.runs, args.workers))
    print(f"sequential: {seq:.1f} runs/s   pool: {pool:.1f} runs/s   pool/sequential = {pool / seq:.2f}x (goal >= 1.8x)")
    bare, sandboxed = overhead_ms(args.runs)
    print(f"bare subprocess: {bare:.1f} ms   sandboxed: {sandboxed:.1f} ms   overhead = {sandboxed - bare:.1f} ms/run "
          f"(goal <= 30 ms), ratio {sandboxed / bare:.2f}x")
    if args.resident_gb > 0:
        heap = b"\x01" * int(args.resident_gb * 1e9)  # written, so resident (untouched zero pages would not be)
        bare_big, sandboxed_big = overhead_ms(args.runs // 4)
        print(f"parent holding {args.resident_gb:g} GB: bare {bare_big:.1f} ms   sandboxed {sandboxed_big:.1f} ms   "
              f"overhead = {sandboxed_big - bare_big:.1f} ms/run (goal <= 30 ms)")
        del heap
    print(f"load average (1 min) at end={os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
