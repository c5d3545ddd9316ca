"""GSM8K-format problems through the inspect provider ``tinker/<model>`` against localtinker: batched vs one at a time.

Workload: ``--problems`` (200) GSM8K-format problems (``question`` / ``answer`` ending ``#### N``, written
as a local copy of ``openai/gsm8k`` in the hub's layout), run as the ``gsm8k`` benchmark by
``posttrain.benchmarks.runner.run_benchmark`` — inspect task, provider, SDK, in-process localtinker
(SmolLM2-135M-Instruct, float32) — greedy, ``--max-tokens`` (32) per answer.

Ours: every problem in flight at once (``max_connections`` = the problem count), so the server's
decoder batches them. Baseline, in the same process and through the same code: ``max_connections=1``,
one request at a time, over the first ``--baseline-problems`` (40) problems; its time per problem
stands for the whole set (the problems share one template and one answer budget; the generated-token
rates are printed beside it as a check). Goal: ratio >= 4.

Outside-the-engine share: the wall time of ours minus the time the localtinker worker spent in the
engine's sampling steps (``SampleStream.step``, timed by wrapping it), over the wall time: task
building, inspect's solver/scorer/log writing, the provider, the SDK and HTTP. Goal: <= 10%.

Usage: ``python bench/bench_inspect_provider.py [--model HuggingFaceTB/SmolLM2-135M-Instruct] [--threads 1]``
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from localtinker.engine import sample_stream  # noqa: E402
from localtinker.server import start_server  # noqa: E402
from posttrain.benchmarks.runner import ModelTarget, run_benchmark  # noqa: E402
from resources.models import tokenizer_path  # noqa: E402

NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies"]


class EngineClock:
    """Total time the server's worker spends inside the engine's sampling steps."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()
        original = sample_stream.SampleStream.step

        def timed_step(stream, *args, **kwargs):
            started = time.perf_counter()
            try:
                return original(stream, *args, **kwargs)
            finally:
                with self._lock:
                    self.seconds += time.perf_counter() - started

        sample_stream.SampleStream.step = timed_step

    def reset(self) -> float:
        with self._lock:
            seconds, self.seconds = self.seconds, 0.0
        return seconds


def gsm8k_mirror(root: Path, count: int, seed: int = 0) -> Path:
    """``count`` GSM8K-format problems at ``<root>/openai/gsm8k`` (the hub's layout and columns)."""
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < count:
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        have, buy, give = rng.randint(5, 60), rng.randint(2, 30), rng.randint(1, 4)
        total = have + buy * give
        if (name, item, have, buy, give) in seen:  # inspect ids samples by question: no duplicates
            continue
        seen.add((name, item, have, buy, give))
        rows.append({
            "question": f"{name} has {have} {item}. {name} buys {give} bags with {buy} {item} in each bag. How many {item} does {name} have now?",
            "answer": f"{name} buys {give} * {buy} = <<{give}*{buy}={buy * give}>>{buy * give} {item}.\n"
                      f"{have} + {buy * give} = <<{have}+{buy * give}={total}>>{total}\n#### {total}",
        })
    repo = root / "openai" / "gsm8k"
    (repo / "main").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), repo / "main" / "test-00000-of-00001.parquet")
    (repo / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: test\n    path: main/test-*\n---\n")
    return root


def timed_run(target: ModelTarget, log_dir: Path, limit: int, connections: int, max_tokens: int, clock: EngineClock):
    clock.reset()
    started = time.perf_counter()
    result = run_benchmark("gsm8k", target, log_dir, limit=limit, task_args={"max_tokens": max_tokens}, max_connections=connections)
    wall = time.perf_counter() - started
    tokens = sum(len(row["completion"]) for row in result.samples)  # characters: a proxy for the work, same on both sides
    return result, wall, clock.reset(), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--baseline-problems", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = EngineClock()
    with tempfile.TemporaryDirectory(prefix="bench-inspect-") as scratch:
        os.environ["POSTTRAIN_HUB_MIRROR"] = str(gsm8k_mirror(Path(scratch) / "hub", args.problems))
        with start_server(Path(scratch) / "storage", dtype="float32") as server:
            target = ModelTarget(args.model, "chatml", server.base_url, "tml-local", tokenizer_path(args.model))
            timed_run(target, Path(scratch) / "warmup", 2, 2, 4, clock)  # model load, first compile, caches
            _, base_wall, base_engine, base_chars = timed_run(
                target, Path(scratch) / "baseline", args.baseline_problems, 1, args.max_tokens, clock)
            print(f"baseline done: {base_wall:.1f} s", flush=True)
            result, ours_wall, ours_engine, ours_chars = timed_run(
                target, Path(scratch) / "ours", args.problems, args.problems, args.max_tokens, clock)
            print(f"ours done: {ours_wall:.1f} s", flush=True)
    per_problem_base = base_wall / args.baseline_problems
    per_problem_ours = ours_wall / args.problems
    ratio = per_problem_base / per_problem_ours
    outside = 1.0 - ours_engine / ours_wall
    print(f"model {args.model}, {args.problems} problems, {args.max_tokens} tokens max, torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"baseline (one at a time, {args.baseline_problems} problems): {base_wall:.1f} s, {per_problem_base:.3f} s/problem, "
          f"{base_chars / base_wall:.0f} answer chars/s, engine {base_engine / base_wall:.0%} of wall")
    print(f"ours (all {args.problems} in flight): {ours_wall:.1f} s, {per_problem_ours:.3f} s/problem, "
          f"{ours_chars / ours_wall:.0f} answer chars/s; gsm8k {result.metric} {result.value:.3f} ± {result.stderr:.3f} (n={result.n})")
    print(f"ratio over one at a time: {ratio:.2f}x (goal >= 4)")
    print(f"share of wall time outside the engine: {outside:.1%} (goal <= 10%; engine {ours_engine:.1f} s of {ours_wall:.1f} s)")


if __name__ == "__main__":
    main()
