"""Where a profiled call's time went, from a trace ``bench_gpu.py --profile --trace-dir DIR`` wrote.

For each named range (the GRPO step's ``grpo.*`` parts): its host time, its device span and how much of that
span the device was busy, and its costliest kernels. For CUDA graph replays (decode steps): how many kernels
one replay runs, its device span and busy time, and that replay's kernels by total time. A device busy for a
small share of a range's span means the host is what bounds it.

    python bench/trace_summary.py DIR/grpo-step.json.gz [--top 8]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter, defaultdict
from pathlib import Path

DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return [event for event in json.load(handle)["traceEvents"] if event.get("ph") == "X"]


def by_time(events: list[dict], top: int) -> list[str]:
    total, count = Counter(), Counter()
    for event in events:
        name = event["name"][:80]
        total[name] += event["dur"]
        count[name] += 1
    return [f"    {micros / 1e3:8.2f} ms  {count[name]:5d}×  {name}" for name, micros in total.most_common(top)]


def ranges(events: list[dict], device: list[dict], top: int) -> list[str]:
    host = {e["name"]: e for e in events if e.get("cat") == "user_annotation"}
    on_device = {e["name"]: e for e in events if e.get("cat") == "gpu_user_annotation"}
    lines = []
    for name, span in sorted(on_device.items(), key=lambda item: item[1]["ts"]):
        start, end = span["ts"], span["ts"] + span["dur"]
        inside = [k for k in device if start <= k["ts"] < end]
        busy = sum(k["dur"] for k in inside)
        host_ms = host[name]["dur"] / 1e3 if name in host else float("nan")
        lines.append(f"{name}: host {host_ms:.1f} ms, device span {span['dur'] / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms "
                     f"({busy / max(span['dur'], 1):.0%}), {len(inside)} kernels")
        lines += by_time(inside, top)
    return lines


def graph_replays(events: list[dict], device: list[dict], top: int) -> list[str]:
    launches = sorted((e for e in events if e["name"] == "cudaGraphLaunch"), key=lambda e: e["ts"])
    if not launches:
        return []
    replay_of = {e["args"].get("correlation"): i for i, e in enumerate(launches)}
    kernels: dict[int, list[dict]] = defaultdict(list)
    for kernel in device:
        index = replay_of.get(kernel["args"].get("correlation"))
        if index is not None:
            kernels[index].append(kernel)
    spans = [(ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"], sum(k["dur"] for k in ks), len(ks)) for ks in kernels.values()]
    spans.sort()
    middle = spans[len(spans) // 2]
    launch_host = sorted(e["dur"] for e in launches)[len(launches) // 2]
    lines = [f"graph replays: {len(launches)}; the median replay: {middle[2]} kernels, device span "
             f"{middle[0] / 1e3:.2f} ms, busy {middle[1] / 1e3:.2f} ms; cudaGraphLaunch {launch_host / 1e3:.2f} ms of host time"]
    typical = next(ks for ks in kernels.values() if (ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]) == middle[0])
    return lines + by_time(typical, top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    events = load(args.trace)
    device = sorted((e for e in events if e.get("cat") in DEVICE_WORK), key=lambda e: e["ts"])
    if device:
        span = device[-1]["ts"] + device[-1]["dur"] - device[0]["ts"]
        busy = sum(k["dur"] for k in device)
        print(f"{args.trace.name}: device span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, {len(device)} kernels")
    else:
        print(f"{args.trace.name}: no device work recorded (a CPU run)")
    for line in ranges(events, device, args.top) + graph_replays(events, device, args.top):
        print(line)


if __name__ == "__main__":
    main()
