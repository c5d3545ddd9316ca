"""localtinker under concurrent load: N SDK clients training + sampling vs one client alone, same server.

Baseline: one client running the loadgen loop (train one step, every other step snapshot weights and
sample) alone for the same duration. Measured: N clients doing it at once (``localtinker.loadgen``). Prints
both latency tables (client futures; server requests incl. ``retrieve_future``) and the ratios: aggregate
train steps/s (N clients over one; > 1 means the server overlaps clients' work) and median sample latency
(N clients over one: the queueing cost each client sees). Also checks that no client saw another's weights.

    python bench/bench_server_load.py [--clients 8] [--duration 30] [--model localtinker/tiny-random] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import torch  # noqa: E402

from localtinker.loadgen import LoadConfig, LoadReport, run_load  # noqa: E402
from localtinker.server import start_server  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of the timed phase, per run")
    parser.add_argument("--model", default="localtinker/tiny-random")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server's engine")
    parser.add_argument("--json", type=str, default=None, help="also write both reports to this file")
    return parser.parse_args()


def _steps_per_second(report: LoadReport) -> float:
    """All clients' steps over the timed phase (which outlasts ``duration`` when ``min_steps`` binds)."""
    return sum(c.steps for c in report.clients) / max(c.train_seconds for c in report.clients)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    reports: dict[str, LoadReport] = {}
    with tempfile.TemporaryDirectory() as storage, start_server(storage, dtype="float32") as server:
        for label, clients in (("baseline: 1 client", 1), (f"{args.clients} clients", args.clients)):
            config = LoadConfig(base_model=args.model, clients=clients, duration_s=args.duration)
            report = run_load(config, server.base_url, "tml-local")
            reports[label] = report
            phase = max(c.train_seconds for c in report.clients)
            print(f"== {label}: {sum(c.steps for c in report.clients)} steps in {phase:.1f} s, {report.wall_seconds:.1f} s wall")
            print(report.table())
    alone, loaded = reports.values()
    ratio_throughput = _steps_per_second(loaded) / _steps_per_second(alone)
    ratio_sample = loaded.latency_ms["client sample"]["p50"] / alone.latency_ms["client sample"]["p50"]
    print(f"aggregate train steps/s, {args.clients} clients / 1 client: {ratio_throughput:.2f}")
    print(f"median sample latency,   {args.clients} clients / 1 client: {ratio_sample:.2f}")
    problems = [*alone.errors, *loaded.errors] + [
        f"client {c.client} does not own its weights" for c in loaded.clients if not c.owns_its_weights
    ]
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({label: report.to_json() for label, report in reports.items()}, handle, indent=2)
    for problem in problems:
        print("ERROR", problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
