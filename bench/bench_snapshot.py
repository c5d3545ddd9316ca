"""An RL step's weight snapshot: ``create_ephemeral_sampler`` + the sampler's adapter import, per step.

Workload: SmolLM2-135M-Instruct with a LoRA adapter of ``--rank`` on every linear layer and the unembedding
(45 MB at rank 32), the weights changed before each of ``--steps`` steps as an optimizer step would. Each step
takes a snapshot and makes it the sampler's resident adapter (``sampling_target``), which is what an RL loop's
``save_weights_and_get_sampling_client`` + first sample cost on top of the sampling itself.

- ours: the engine as it is (snapshots.py keeps the newest snapshots in memory within its budget);
- baseline: the same, plus the snapshot's file round trip (``torch.save`` to the engine's storage disk and
  ``torch.load`` back), the work each step did before snapshots were kept in memory.

``--portable`` runs the device-agnostic path a GPU runs (no merged float32 copy of the weights). Both sides run
in float32 and in bfloat16 engines in the same run (bf16 weights change the merge; the adapter and so the
snapshot are float32 in both); each prints the median step (first step dropped), and the headline divides the
faster baseline by ours in that dtype (``measure.dtype_headline``; goal ≥ 1.2).

Usage: ``python bench/bench_snapshot.py [--rank 32] [--steps 8] [--portable]``
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from localtinker.engine.api import LoraSpec
from localtinker.engine.engine import LocalEngine
from localtinker.engine.packaged import SMOLLM2_NAME
from measure import dtype_headline


def step_times(engine: LocalEngine, steps: int, round_trip: Path | None) -> list[float]:
    model = engine._models["m"]
    times = []
    for step in range(steps):
        with torch.no_grad():
            for param in model.params.values():
                param.add_(1e-4)
        model.version += 1
        start = time.perf_counter()
        engine.create_ephemeral_sampler(f"s{step}-{round_trip is not None}", "m")
        if round_trip is not None:
            number = engine._sampler(f"s{step}-True").snapshot
            weights, _ = engine.snapshots.load(number)
            torch.save(weights, round_trip)
            torch.load(round_trip, weights_only=True)
        engine.sampling_target(f"s{step}-{round_trip is not None}").release()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--portable", action="store_true")
    args = parser.parse_args()
    storage = Path(tempfile.mkdtemp(prefix="bench-snapshot-"))
    print(f"SmolLM2-135M, LoRA rank {args.rank}, {'portable' if args.portable else 'tuned CPU'} path, "
          f"{torch.get_num_threads()} threads", flush=True)
    medians: dict[tuple[str, str], float] = {}
    for dtype in ("float32", "bfloat16"):
        engine = LocalEngine(storage / dtype, dtype=dtype, portable=args.portable)
        engine.create_model("m", SMOLLM2_NAME, LoraSpec(rank=args.rank, seed=0))
        megabytes = sum(p.numel() * p.element_size() for p in engine._models["m"].params.values()) / 1e6
        times: dict[str, list[float]] = {}
        for side in ("baseline", "ours", "baseline", "ours"):  # alternating
            round_trip = storage / "round-trip.pt" if side == "baseline" else None
            times.setdefault(side, []).extend(step_times(engine, args.steps, round_trip)[1:])
        for side, seconds in times.items():
            medians[(side, dtype)] = statistics.median(seconds)
            print(f"  {dtype} engine ({megabytes:.1f} MB adapter), {side}: {medians[(side, dtype)] * 1e3:.1f} ms per "
                  f"step (median of {len(seconds)})", flush=True)
        del engine
        gc.collect()
    print(dtype_headline(medians, ">= 1.2"), flush=True)


if __name__ == "__main__":
    main()
