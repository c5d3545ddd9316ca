"""What each finished session leaves behind in a long-running localtinker: resident memory per closed session.

Workload: an in-process localtinker (float32, SmolLM2-135M-Instruct); ``--sessions`` times in turn, a
``ServiceClient`` creates a LoRA rank-32 training client, takes one 64-token step, samples 4 tokens from
``save_weights_and_get_sampling_client`` and closes (``close("success")``). Prints the process's RSS after each
session and the growth per session from the second on (the first pays one-time allocations). A server that kept
every closed session's adapter, Adam state and snapshot grew by ~215 MB per session here; the goal is a flat line
(≤ 25 MB per session: glibc keeps freed memory for reuse, so RSS does not fall, it stops rising).

Not a speed bench, so no baseline to choose: the engine runs in float32, the CPU default; what a closed session
held (adapter, Adam moments, snapshot) is float32 in a bfloat16 engine too.

Usage: ``python bench/bench_session_memory.py [--sessions 8]``
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker
from tinker import types

from localtinker.engine.packaged import SMOLLM2_NAME
from localtinker.server import start_server

KEY = "tml-bench"


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def one_session(base_url: str, seed: int) -> None:
    datum = types.Datum(model_input=types.ModelInput.from_ints(list(range(1, 65))),
                        loss_fn_inputs={"target_tokens": list(range(2, 66)), "weights": [1.0] * 64})
    client = tinker.ServiceClient(base_url=base_url, api_key=KEY)
    trainer = client.create_lora_training_client(base_model=SMOLLM2_NAME, rank=32, seed=seed).result()
    trainer.forward_backward([datum], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=4)).result()
    client.close("success").result(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    args = parser.parse_args()
    with start_server(tempfile.mkdtemp(prefix="bench-session-memory-"), dtype="float32", api_key=KEY) as server:
        sizes = []
        for index in range(args.sessions):
            one_session(server.base_url, index)
            deadline = time.monotonic() + 30  # the worker releases the session's clients just after the goodbye
            while server.engine._models and time.monotonic() < deadline:
                time.sleep(0.05)
            sizes.append(rss_mb())
            print(f"  after session {index + 1}: RSS {sizes[-1]:.0f} MB, training models held "
                  f"{len(server.engine._models)}", flush=True)
    growth = (sizes[-1] - sizes[1]) / max(1, len(sizes) - 2)
    print(f"growth per closed session (2 to {len(sizes)}): {growth:.0f} MB (goal <= 25)", flush=True)


if __name__ == "__main__":
    main()
