"""bench/trace_summary.py on a small trace in the schema torch.profiler's export_chrome_trace writes."""

from __future__ import annotations

import gzip
import json

from bench.trace_summary import DEVICE_WORK, graph_replays, load, ranges


def _trace(tmp_path):
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "grpo.sampling", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "grpo.sampling", "ts": 10, "dur": 900},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 20, "dur": 50, "args": {"correlation": 7}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 500, "dur": 70, "args": {"correlation": 8}},
        {"ph": "i", "cat": "kernel", "name": "an instant event, skipped", "ts": 30},
    ]
    for replay, start in ((7, 100), (8, 600)):
        events += [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": start, "dur": 40, "args": {"correlation": replay}},
                   {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": start + 50, "dur": 10,
                    "args": {"correlation": replay}}]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    return path


def test_ranges_report_how_busy_the_device_was_and_graph_replays_their_kernels(tmp_path):
    events = load(_trace(tmp_path))
    device = sorted((e for e in events if e.get("cat") in DEVICE_WORK), key=lambda e: e["ts"])
    lines = ranges(events, device, top=3)
    assert lines[0] == "grpo.sampling: host 1.0 ms, device span 0.9 ms, busy 0.1 ms (11%), 4 kernels"
    assert "2×  gemm" in lines[1] and "0.08 ms" in lines[1]
    replays = graph_replays(events, device, top=3)
    assert replays[0].startswith("graph replays: 2; the median replay: 2 kernels, device span 0.06 ms, busy 0.05 ms")
    assert replays[0].endswith("cudaGraphLaunch 0.07 ms of host time")
