"""The benches' bf16 policy (bench/measure.py): bf16-autocast baselines are skipped only where bf16 is
emulated (or when told to), and the printed note says which was done."""

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import measure  # noqa: E402

RUNNERS = {"baseline float32": 1, "baseline bf16 autocast": 2, "ours float32": 3}


def probe(monkeypatch: pytest.MonkeyPatch, float32: float, bf16: float, choice: str | None = None,
          packed: tuple[float, float] | None = None) -> measure.Bf16Probe:
    """A probe over faked ``torch.mm`` rates (and oneDNN packed ones, float32 and bf16; None: no such kernel)."""
    monkeypatch.setattr(measure, "mm_peak_gflops", lambda size=1024, min_seconds=0.3, autocast_bf16=False: bf16 if autocast_bf16 else float32)
    monkeypatch.setattr(measure, "packed_peak_gflops",
                        lambda size=1024, min_seconds=0.3, bf16=False: None if packed is None else packed[bf16])
    if choice is None:
        monkeypatch.delenv(measure.BF16_BASELINES_ENV, raising=False)
    else:
        monkeypatch.setenv(measure.BF16_BASELINES_ENV, choice)
    return measure.Bf16Probe()


def test_emulated_bf16_skips_the_autocast_baselines_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    found = probe(monkeypatch, float32=60.0, bf16=1.4)
    assert found.emulated and not found.times_bf16
    assert found.select(RUNNERS) == {"baseline float32": 1, "ours float32": 3}
    made = []
    assert found.build({"baseline bf16 autocast": lambda: made.append("bf16"), "ours float32": lambda: made.append("ours")}) == {"ours float32": None}
    assert made == ["ours"]  # a skipped baseline is never built (its model would only take memory)
    assert "no native bf16" in found.note() and "skipped" in found.note()


def test_native_bf16_times_every_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    found = probe(monkeypatch, float32=60.0, bf16=90.0)
    assert found.select(RUNNERS) == RUNNERS
    assert "timed" in found.note()


def test_the_environment_overrides_the_probe_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    assert probe(monkeypatch, float32=60.0, bf16=1.4, choice="always").select(RUNNERS) == RUNNERS
    assert "autocast" not in " ".join(probe(monkeypatch, float32=60.0, bf16=90.0, choice="never").select(RUNNERS))
    with pytest.raises(SystemExit, match="BENCH_BF16_BASELINES='sometimes'"):
        probe(monkeypatch, float32=60.0, bf16=90.0, choice="sometimes")


def test_the_peak_is_a_real_measurement() -> None:
    assert measure.mm_peak_gflops(size=128, min_seconds=0.01) > 0.1


def test_the_peak_keeps_measuring_for_min_seconds() -> None:
    """A host's short stalls cannot set the peak: it is the best of every product over the window."""
    started = time.perf_counter()
    measure.mm_peak_gflops(size=64, min_seconds=0.2)
    assert time.perf_counter() - started >= 0.2


@pytest.mark.parametrize(("float32", "bf16", "expected"), [(60.0, 1.4, "float32"), (60.0, 130.0, "bfloat16"), (60.0, 70.0, "float32")])
def test_auto_dtype_follows_native_bf16_with_the_engines_margin(monkeypatch: pytest.MonkeyPatch, float32, bf16, expected) -> None:
    found = probe(monkeypatch, float32=float32, bf16=bf16)
    assert found.engine_dtype("auto") == expected
    assert found.engine_dtype("float32") == "float32"  # an explicit choice is kept


def test_the_headline_compares_ours_in_the_faster_baselines_precision() -> None:
    rates = {"baseline loop float32": 100.0, "baseline loop bf16 autocast": 200.0,
             "ours LocalEngine float32": 130.0, "ours LocalEngine bfloat16": 190.0}
    text = measure.headline_ratio(rates, ">= 1.2")
    assert text.splitlines()[0] == (
        "ratio = ours LocalEngine bfloat16 / faster baseline (baseline loop bf16 autocast) = 0.95 (goal >= 1.2)")
    assert "float32: ours LocalEngine float32 / baseline loop float32 = 1.30" in text
    float32_only = {"baseline loop float32": 100.0, "ours LocalEngine float32": 130.0}
    assert measure.headline_ratio(float32_only, ">= 1.2") == (
        "ratio = ours LocalEngine float32 / faster baseline (baseline loop float32) = 1.30 (goal >= 1.2)")


def test_each_runner_is_reported_against_the_peak_of_its_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    from localtinker.engine import bf16_matmul

    monkeypatch.setattr(bf16_matmul, "bf16_matmul_is_fast", lambda: True)
    peaks = measure.Peaks(probe(monkeypatch, float32=100.0, bf16=200.0))
    assert "50% of the float32 matmul peak (100.0" in peaks.report("ours LocalEngine float32", 50e9, 1.0)
    assert "25% of the bf16 matmul peak (200.0" in peaks.report("ours LocalEngine bfloat16", 50e9, 1.0)
    assert "bf16 matmul peak" in peaks.report("baseline bf16 autocast", 50e9, 1.0)
    monkeypatch.setattr(bf16_matmul, "bf16_matmul_is_fast", lambda: False)  # our bf16 mode multiplies in float32
    assert "float32 matmul peak" in peaks.report("ours LocalEngine bfloat16", 50e9, 1.0)
    emulated = measure.Peaks(probe(monkeypatch, float32=100.0, bf16=1.0))  # no bf16 baselines: no bf16 peak
    assert emulated.bf16 is None and "float32 matmul peak" in emulated.report("baseline bf16 autocast", 50e9, 1.0)


def test_the_peak_is_the_faster_kernels_whichever_that_is(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """On a Zen 5 EPYC MKL's float32 ``torch.mm`` ran at 108 GFLOP/s and oneDNN's packed kernel at 252:
    a peak from ``torch.mm`` alone let ours read 133% of it."""
    peaks = measure.Peaks(probe(monkeypatch, float32=100.0, bf16=200.0, packed=(250.0, 180.0)))
    assert peaks.float32 == 250.0 and peaks.float32_peak.kernel == "oneDNN packed; torch.mm 100.0"
    assert peaks.bf16 == 200.0 and peaks.bf16_peak.kernel == "bf16-autocast torch.mm; oneDNN packed 180.0"
    assert peaks.float32_peak.mm_gflops == 100.0 and peaks.bf16_peak.mm_gflops == 200.0
    # The share of torch.mm's rate is stated beside it when another kernel set the peak, and only then.
    assert peaks.report("ours LocalEngine float32", 100e9, 1.0).endswith(
        "40% of the float32 matmul peak (250.0 GFLOP/s); 100% of torch.mm's 100.0")
    assert "torch.mm's" not in peaks.report("baseline bf16 autocast", 100e9, 1.0)
    assert "oneDNN packed; torch.mm 100.0" in capsys.readouterr().out


def test_the_packed_kernels_peak_is_a_real_measurement_where_torch_has_it() -> None:
    from localtinker.engine.packed_linear import packing_available

    rate = measure.packed_peak_gflops(size=128, min_seconds=0.01)
    assert (rate is None) == (not packing_available()) and (rate is None or rate > 0.1)


THREAD_COUNTS = """
import os, sys, time, torch
sys.path.insert(0, sys.argv[1])
import measure
torch.set_num_threads(2)
threads = lambda: len(os.listdir("/proc/self/task"))
a, b = torch.randn(512, 512), torch.randn(512, 512)
before = threads()
product = measure.in_own_thread(lambda: torch.mm(a, b))
settled = time.monotonic() + 5  # an ended thread's team exits asynchronously; a kept one never does
while threads() != before and time.monotonic() < settled:
    time.sleep(0.01)
after_own = threads()
assert torch.equal(product, torch.mm(a, b))  # the main thread's first parallel region: its team starts here
print(before, after_own, threads())
"""


def test_own_thread_measurements_leave_no_openmp_team_behind() -> None:
    """A 2-thread product on a thread of its own leaves the process's thread count as it was; the same
    product on the main thread keeps one more (its OpenMP worker), the team that would throttle an
    in-process engine's. Run in a fresh interpreter: pytest's main thread may already have a team."""
    import subprocess

    bench_dir = str(Path(measure.__file__).parent)
    done = subprocess.run([sys.executable, "-c", THREAD_COUNTS, bench_dir], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    before, after_own, after_main = map(int, done.stdout.split())
    assert after_own == before
    assert after_main == before + 1


def test_own_thread_returns_the_value_and_raises_the_error() -> None:
    assert measure.in_own_thread(lambda: 41 + 1) == 42
    with pytest.raises(ZeroDivisionError):
        measure.in_own_thread(lambda: 1 / 0)


TEAM_SIZE = """
import os, sys, threading, torch
sys.path.insert(0, sys.argv[1])
import measure
torch.set_num_threads(1)
a, b = torch.randn(512, 512), torch.randn(512, 512)
threads = lambda: set(os.listdir("/proc/self/task"))
inside = {}

def count_during_mm(key):
    before = threads()
    torch.mm(a, b)
    # OpenMP workers this thread's product started: new thread ids only, since an ended thread's team
    # may still be exiting while this one counts.
    inside[key] = len(threads() - before)

bare = threading.Thread(target=count_during_mm, args=("bare",))
bare.start(); bare.join()
measure.in_own_thread(lambda: count_during_mm("own"))
print(inside["bare"], inside["own"])
"""


def test_own_thread_keeps_the_callers_torch_thread_count() -> None:
    """With 1 torch thread set on the main thread, a bare new thread's first ``torch.mm`` starts a team of
    every core (OpenMP workers beside it, on a multi-core machine); ``in_own_thread`` runs it on the
    caller's 1 thread: no worker."""
    import os
    import subprocess

    bench_dir = str(Path(measure.__file__).parent)
    done = subprocess.run([sys.executable, "-c", TEAM_SIZE, bench_dir], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    bare, own = map(int, done.stdout.split())
    assert own == 0
    assert bare == len(os.sched_getaffinity(0)) - 1  # the bare thread's team: every core this process may use


def test_useful_prefill_counts_each_distinct_prefix_once() -> None:
    """A chat header shared by every prompt is one forward's work, not one per prompt; a prompt repeated for
    a group is prefilled once; a prompt that is a prefix of another still needs its own unembedding."""

    class Config:
        hidden_size, num_hidden_layers, num_key_value_heads, num_attention_heads = 8, 2, 2, 4
        intermediate_size, vocab_size = 16, 32

    flops = measure.FlopModel(Config())
    header = [1, 2, 3]
    prompts = [header + [4, 5], header + [6], header + [4, 5], header]
    # distinct positions: 1, 2, 3 (depths 1-3), then 4, 5 (depths 4, 5) and 6 (depth 4): 6 positions,
    # 1+2+3+4+5+4 = 19 attended keys; distinct prompts ending: [..,5], [..,6], header = 3 unembeddings
    assert flops.prompts_forward(prompts) == flops.forward(6, 19, unembedded=3)
    separately = sum(flops.forward(len(p), flops.causal_keys(len(p)), unembedded=1) for p in prompts)
    assert flops.prompts_forward(prompts) < separately
    assert flops.prompts_forward([[7, 8, 9]]) == flops.forward(3, flops.causal_keys(3), unembedded=1)
