"""Shared by the engine benches: a matmul peak measured in the same run, and a FLOP model of the work.

FLOP convention (stated so the figures can be checked): a forward pass costs 2 FLOPs per weight of
every linear layer (attention projections, MLP, unembedding) per token, plus attention's two
[query × keys] products, 4·d_model FLOPs per attended key per layer. Useful work counts each distinct
token position once (``FlopModel.prompts_forward``): padding is not useful work, and neither is a prefix
several prompts share (a chat template's system prompt), which one forward computes for all of them. (The
sampling benches once counted such a prefix per prompt while our sampler prefills it once, so ours read
117–121% of the float32 peak.) A LoRA training step with frozen
base weights costs 2× its forward (the backward computes activation gradients only; the LoRA weight
gradients are negligible). Peak = the best over ≥ 0.3 s of square products on the same threads, float32
and (where bf16 is timed) bf16, through the fastest kernel torch offers here: ``torch.mm`` (MKL's sgemm in
float32, oneDNN under bf16 autocast) or oneDNN's matmul with the weight packed once (the kernel localtinker
packs its weights for). Each runner is reported against the peak of the precision it computes in
(``Peaks``). Why both kernels: on a Zen 5 EPYC (2026-11-25, one thread) ``torch.mm`` ran float32 at 108
GFLOP/s and the packed oneDNN kernel at 252, so ours read 133% of a "peak" that was MKL's speed, not the box's.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")


# A bf16-autocast baseline is skipped when this CPU's bf16-autocast matmul runs below this fraction of its
# float32 rate: such a CPU (AVX2, no AVX-512 bf16 / AMX) emulates bf16 (measured 1.4 vs 59 GFLOP/s on an
# AVX2 EPYC), so the baseline is many times slower than the same loop in float32 and can never be the faster
# baseline the headline ratio divides by; timing it would take most of the run. BENCH_BF16_BASELINES=always
# times it anyway, =never skips it everywhere.
EMULATED_BF16_BELOW = 0.5
BF16_BASELINES_ENV = "BENCH_BF16_BASELINES"


def server_bench_options(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parses a server bench's arguments after adding the options they share, ``--threads`` (applied here:
    every side runs on that many torch threads) and ``--dtype`` (resolve ``auto`` with
    ``Bf16Probe.engine_dtype``)."""
    parser.add_argument("--threads", type=int, default=1, help="torch threads for every side (0 = torch default)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="localtinker engine dtype; auto = bfloat16 where bf16 is native here, else float32")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}", flush=True)
    return args


def in_own_thread(run: Callable[[], T]) -> T:
    """``run()`` on a thread that ends with it, so the OpenMP team its torch ops start ends too.

    Why: torch's CPU wheel parallelises through libgomp, which gives every thread that starts a parallel
    region a team of its own, kept after the region. Once the process holds more team threads than CPUs,
    libgomp stops letting any team's idle workers spin (100 spins instead of 300,000) and puts them to sleep
    on a futex after every region, so each of an engine step's thousands of small parallel ops pays a
    wake-up. On 2 cores, one 2-thread ``torch.mm`` on the main thread before an in-process localtinker
    (whose engine computes on its own worker thread) made the GRPO step of ``bench_rl_step.py`` 1.5×
    slower for the rest of the process (6.6–7.3 s → 9.8–10.9 s per step; engine worker threads' CPU 27 s
    + 13 s instead of 23 s + 20 s). A bench's own measurements (peaks, the bf16 probe) must not leave such
    a team behind on the main thread to slow a side that runs later on another thread.

    The new thread first takes the caller's ``torch.get_num_threads()``: OpenMP's thread count is per
    thread, and torch applies its setting to a new thread only at the thread's first ``parallel_for`` op, so
    a ``torch.mm`` there would otherwise run on every core (measured: a 1-thread bench's float32 peak read
    169 instead of ~100 GFLOP/s)."""
    outcome: dict[str, object] = {}
    threads = torch.get_num_threads()

    def target() -> None:
        try:
            torch.set_num_threads(threads)
            outcome["value"] = run()
        except BaseException as error:  # re-raised on the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name="bench-own-thread")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def best_gflops(product: Callable[[], object], flops: float, min_seconds: float) -> float:
    """Best GFLOP/s of ``product()`` (``flops`` each) over at least ``min_seconds`` and 5 runs, after one
    warm-up, measured on a thread of its own (``in_own_thread``).

    The best, not the mean: a peak is a limit, and a short window can fall entirely in a slow moment of a
    shared virtual machine. Five products (~0.1 s) once read 59 GFLOP/s for a float32 peak the same process
    had measured at 89 GFLOP/s minutes earlier (a rerun: 85–96)."""

    def measure() -> float:
        product()
        best = float("inf")
        started, repeats = time.perf_counter(), 0
        while repeats < 5 or time.perf_counter() - started < min_seconds:
            start = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - start)
            repeats += 1
        return flops / best / 1e9

    return in_own_thread(measure)


def mm_peak_gflops(size: int = 1024, min_seconds: float = 0.3, autocast_bf16: bool = False) -> float:
    """Best GFLOP/s of a float32 [size × size] @ [size × size] ``torch.mm`` (under ``torch.autocast(bfloat16)``
    with ``autocast_bf16``): what a plain loop's products get (``Bf16Probe`` compares the two)."""
    a, b = torch.randn(size, size), torch.randn(size, size)

    def product() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
            torch.mm(a, b)

    return best_gflops(product, 2 * size**3, min_seconds)


def packed_peak_gflops(size: int = 1024, min_seconds: float = 0.3, bf16: bool = False) -> float | None:
    """Best GFLOP/s of the same product through oneDNN with the weight packed once (float32, or bf16 inputs
    and weight), or None where torch has no such kernel here (``packed_linear.packing_available``)."""
    from localtinker.engine.packed_linear import pack_weight, packed_linear, packing_available

    dtype = torch.bfloat16 if bf16 else torch.float32
    if not packing_available(dtype):
        return None
    x = torch.randn(size, size).to(dtype)
    packed = pack_weight(torch.randn(size, size).to(dtype))
    return best_gflops(lambda: packed_linear(x, packed), 2 * size**3, min_seconds)


@dataclass(frozen=True)
class Peak:
    """A precision's matmul peak: the faster kernel's GFLOP/s, which kernel that was, and ``torch.mm``'s own
    rate (the peak the SFT and sampling goals were first stated against; a report gives the share of both)."""

    gflops: float
    kernel: str
    mm_gflops: float

    @staticmethod
    def measure(bf16: bool, size: int = 1024, min_seconds: float = 0.3) -> Peak:
        mm = mm_peak_gflops(size, min_seconds, autocast_bf16=bf16)
        rates = {"bf16-autocast torch.mm" if bf16 else "torch.mm": mm}
        packed = packed_peak_gflops(size, min_seconds, bf16=bf16)
        if packed is not None:
            rates["oneDNN packed"] = packed
        kernel = max(rates, key=rates.get)
        others = ", ".join(f"{name} {rate:.1f}" for name, rate in rates.items() if name != kernel)
        return Peak(rates[kernel], kernel if not others else f"{kernel}; {others}", mm)


class Bf16Probe:
    """How fast this CPU runs bf16-autocast matmuls relative to float32, measured once per bench run, and
    whether the bench's bf16-autocast baselines are timed (``times_bf16``): where bf16 is native, or when
    ``BENCH_BF16_BASELINES=always``. ``note()`` says which and why; a bench prints it."""

    def __init__(self) -> None:
        self.float32_gflops = mm_peak_gflops(size=512)
        self.bf16_gflops = mm_peak_gflops(size=512, autocast_bf16=True)
        self.speed = self.bf16_gflops / self.float32_gflops
        self.choice = os.environ.get(BF16_BASELINES_ENV, "auto")
        if self.choice not in ("auto", "always", "never"):
            raise SystemExit(f"{BF16_BASELINES_ENV}={self.choice!r}: use auto (default), always or never")

    @property
    def emulated(self) -> bool:
        return self.speed < EMULATED_BF16_BELOW

    @property
    def times_bf16(self) -> bool:
        return self.choice == "always" or (self.choice == "auto" and not self.emulated)

    def engine_dtype(self, choice: str) -> str:
        """The localtinker dtype for ``--dtype choice``: ``auto`` matches the precision the faster baseline
        will have here, bfloat16 where this CPU's bf16-autocast matmul beats float32 by the engine's own
        margin (``bf16_matmul.REQUIRED_SPEEDUP``: its bf16 mode then computes in bf16), float32 elsewhere."""
        if choice != "auto":
            return choice
        from localtinker.engine.bf16_matmul import REQUIRED_SPEEDUP

        return "bfloat16" if self.times_bf16 and self.speed >= REQUIRED_SPEEDUP else "float32"

    def select(self, runners: dict) -> dict:
        """``runners`` without the bf16-autocast baselines (names containing "autocast") when they are skipped."""
        return runners if self.times_bf16 else {name: r for name, r in runners.items() if "autocast" not in name}

    def build(self, builders: dict) -> dict:
        """``select(builders)``, each builder called: only the runners this run times are ever made."""
        return {name: build() for name, build in self.select(builders).items()}

    def note(self) -> str:
        head = f"bf16-autocast torch.mm {self.bf16_gflops:.1f} vs float32 {self.float32_gflops:.1f} GFLOP/s ({self.speed:.2f}x)"
        if self.times_bf16:
            return f"{head}: bf16-autocast baselines timed; the headline ratio divides by the faster baseline"
        why = "no native bf16 on this CPU" if self.emulated else f"{BF16_BASELINES_ENV}=never"
        return (f"{head}: {why}, so the bf16-autocast baselines are skipped (they cannot be the faster baseline; "
                f"{BF16_BASELINES_ENV}=always times them); the headline ratio divides by the float32 baseline")


class FlopModel:
    """Forward FLOPs of a Llama-style model from its config."""

    def __init__(self, config) -> None:
        d, layers = config.hidden_size, config.num_hidden_layers
        kv = d * config.num_key_value_heads // config.num_attention_heads
        self.body_weights = layers * (2 * d * d + 2 * d * kv + 3 * d * config.intermediate_size)
        self.unembedding_weights = d * config.vocab_size
        self.flops_per_attended_key = 4 * d * layers

    def forward(self, tokens: int, attended_keys: int, unembedded: int | None = None) -> float:
        """``tokens`` through the layers, ``attended_keys`` (query, key) pairs in all, ``unembedded``
        positions through the unembedding (default: every token)."""
        unembedded = tokens if unembedded is None else unembedded
        return (2 * self.body_weights * tokens + 2 * self.unembedding_weights * unembedded
                + self.flops_per_attended_key * attended_keys)

    def prompts_forward(self, prompts: Iterable[Sequence[int]]) -> float:
        """Prefill of ``prompts`` doing no work twice: every distinct prefix (a node of the prompts' token
        trie) runs once, attending to the positions up to its own, and each distinct prompt's last position
        goes through the unembedding (its first sampled token needs it)."""
        distinct = {tuple(prompt) for prompt in prompts}
        trie: dict = {}
        positions = attended = 0
        for prompt in distinct:
            node = trie
            for depth, token in enumerate(prompt, start=1):
                if token not in node:
                    node[token] = {}
                    positions, attended = positions + 1, attended + depth
                node = node[token]
        return self.forward(positions, attended, unembedded=len(distinct))

    def causal_keys(self, length: int) -> int:
        """(query, key) pairs of one causal sequence of ``length`` tokens."""
        return length * (length + 1) // 2


class Peaks:
    """The box's physical limits, measured in the run on the bench's threads: the float32 matmul peak, and
    the bf16 one where the bench times bf16 (``Bf16Probe.times_bf16``), each the faster of ``torch.mm`` and
    oneDNN's packed kernel (``Peak.measure``). A runner computing in bf16 (an autocast baseline, ours
    ``bfloat16``) is reported against the bf16 peak, the others against float32: 150% of the float32 peak
    says less than the share of the limit the bf16 kernels set."""

    def __init__(self, probe: Bf16Probe) -> None:
        self.float32_peak = Peak.measure(bf16=False)
        self.bf16_peak = Peak.measure(bf16=True) if probe.times_bf16 else None
        print(f"matmul peaks: float32 {self.float32_peak.gflops:.1f} GFLOP/s ({self.float32_peak.kernel})"
              + (f"; bf16 {self.bf16_peak.gflops:.1f} ({self.bf16_peak.kernel})" if self.bf16_peak else ""), flush=True)

    @property
    def float32(self) -> float:
        return self.float32_peak.gflops

    @property
    def bf16(self) -> float | None:
        return None if self.bf16_peak is None else self.bf16_peak.gflops

    def report(self, name: str, flops: float, seconds: float) -> str:
        from localtinker.engine.bf16_matmul import bf16_matmul_is_fast  # ours bfloat16 multiplies in bf16 only then

        in_bf16 = self.bf16 is not None and ("autocast" in name or ("bfloat16" in name and bf16_matmul_is_fast()))
        peak = self.bf16_peak if in_bf16 else self.float32_peak
        line = report(flops, seconds, peak.gflops, "bf16" if in_bf16 else "float32")
        if peak.mm_gflops == peak.gflops:
            return line
        return f"{line}; {100 * flops / seconds / 1e9 / peak.mm_gflops:.0f}% of torch.mm's {peak.mm_gflops:.1f}"


def report(flops: float, seconds: float, peak_gflops: float, kind: str = "float32") -> str:
    achieved = flops / seconds / 1e9
    return f"{achieved:.1f} GFLOP/s = {100 * achieved / peak_gflops:.0f}% of the {kind} matmul peak ({peak_gflops:.1f} GFLOP/s)"


def headline_ratio(rates: dict[str, float], goal: str) -> str:
    """``ours / the faster baseline``, ours in that baseline's precision: ``ours LocalEngine float32`` against
    a float32 baseline, ``ours LocalEngine bfloat16`` against a bf16-autocast one (a CPU with native bf16
    makes autocast the faster baseline; a bf16 user would pick our bfloat16 mode there). Rates are
    higher-is-better; names follow the benches' convention (baselines start with "baseline", autocast
    ones contain "autocast"). Also states the other precision's ratio when both sides were timed."""
    baselines = {name: rate for name, rate in rates.items() if name.startswith("baseline")}
    faster = max(baselines, key=baselines.get)
    precision = "bfloat16" if "autocast" in faster else "float32"
    ours = f"ours LocalEngine {precision}"
    if ours not in rates:  # a bench with one mode of ours
        ours = next(name for name in rates if name.startswith("ours"))
    lines = [f"ratio = {ours} / faster baseline ({faster}) = {rates[ours] / baselines[faster]:.2f} (goal {goal})"]
    for other in ("float32", "bfloat16"):
        pair = (f"ours LocalEngine {other}", next((b for b in baselines if ("autocast" in b) == (other == "bfloat16")), None))
        if other != precision and pair[0] in rates and pair[1] is not None:
            lines.append(f"  same precision, {other}: {pair[0]} / {pair[1]} = {rates[pair[0]] / rates[pair[1]]:.2f}")
    return "\n".join(lines)


def dtype_headline(seconds: dict[tuple[str, str], float], goal: str, cost: bool = False) -> str:
    """For benches whose baseline is localtinker itself doing the work another way, timed in both engine
    dtypes in one run: ``seconds[(side, dtype)]`` with side ``baseline`` or ``ours``. The headline takes the
    dtype whose baseline is faster and divides its baseline by ours there (a speed-up), or with ``cost`` ours
    by the baseline (what ours costs over the baseline); the other dtype's ratio is stated beside it."""
    dtypes = sorted({dtype for _, dtype in seconds})
    faster = min(dtypes, key=lambda dtype: seconds[("baseline", dtype)])

    def ratio(dtype: str) -> float:
        speedup = seconds[("baseline", dtype)] / seconds[("ours", dtype)]
        return 1 / speedup if cost else speedup

    name = "ours / baseline" if cost else "baseline / ours"
    lines = [f"ratio = {name} in {faster} (the faster baseline) = {ratio(faster):.2f}x (goal {goal})"]
    lines += [f"  {dtype}: {name} = {ratio(dtype):.2f}x" for dtype in dtypes if dtype != faster]
    return "\n".join(lines)
