"""``make demo`` through the GPU's code path, on whatever device this machine has (docs/localtinker-gpu.md).

The embedded localtinker runs the portable engine a GPU runs (bf16 weights, the written-out training layers,
the static decoder), here on the CPU when there is no GPU: the CUDA-only parts (compiled pieces, CUDA graphs,
flash kernels) are the only difference. A device session is rare; this checks the whole chain on that path
before one. Prints the demo's tables, then the process's peak resident memory.

    POSTTRAIN_STATE_DIR=/tmp/gpu-path .venv/bin/python scripts/demo_gpu_path.py --max-steps 12 --final-only
"""

from __future__ import annotations

import atexit
import resource
import sys
from pathlib import Path

import localtinker.server as server


def portable_engine(storage_dir: Path, dtype: str | None = None, num_threads: int | None = None,
                    device: str | None = None):
    from localtinker.engine.device import resolve_device
    from localtinker.engine.engine import LocalEngine

    return LocalEngine(Path(storage_dir), dtype="bfloat16", num_threads=num_threads, device=resolve_device(device),
                       portable=True, static_decode=True, train_layers=True)


def main(argv: list[str]) -> int:
    server.build_engine = portable_engine  # what start_server (the Tinker resource's embedded server) calls
    atexit.register(lambda: print(f"peak resident memory: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB",
                                  flush=True))
    from pipelines.__main__ import main as pipelines_main

    return pipelines_main(["demo", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
