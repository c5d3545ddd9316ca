"""Device selection: auto | cpu | cuda[:N], from the caller or $LOCALTINKER_DEVICE, with clear errors."""

from __future__ import annotations

import importlib.util
import logging
import threading

import pytest
import torch

from localtinker.__main__ import parse_args
from localtinker.engine import decode_layer
from localtinker.engine.decode_layer import TRAIN_COMPILE_ENV, compile_by_default
from localtinker.engine.api import EngineUserError
from localtinker.engine.device import (
    DeviceLock, card_summary, default_dtype, describe_device, device_scope, dtype_warning, resolve_device,
)
from localtinker.engine.engine import LocalEngine, RoutedSampleStream
from localtinker.engine.expert_lora import grouped_possible
from localtinker.engine.portable_attention import varlen_available
from localtinker.server import build_engine


def test_auto_is_the_gpu_when_torch_sees_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCALTINKER_DEVICE", raising=False)
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None) == resolve_device("auto")
    assert resolve_device("CPU") == torch.device("cpu")


def test_the_environment_chooses_when_the_caller_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALTINKER_DEVICE", "cpu")
    assert resolve_device(None) == torch.device("cpu")
    monkeypatch.setenv("LOCALTINKER_DEVICE", "tpu")
    with pytest.raises(ValueError, match="'tpu' is not one of auto, cpu, cuda or cuda:N.*LOCALTINKER_DEVICE"):
        resolve_device(None)
    assert resolve_device("cpu") == torch.device("cpu")  # the caller's choice wins


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_says_how_to_fix_it() -> None:
    with pytest.raises(ValueError, match="sees no CUDA GPU; use --device cpu"):
        resolve_device("cuda:0")


def test_build_engine_resolves_device_and_dtype(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALTINKER_DEVICE", "cpu")
    engine = build_engine(tmp_path, dtype="auto")
    assert (engine.device, engine.dtype, engine.portable) == (torch.device("cpu"), "float32", None)


def test_cuda_devices_resolve_by_number_on_a_machine_with_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine with two GPUs (faked: the counts are all the choice reads), ``auto`` is the current one,
    ``cuda`` the first, ``cuda:1`` the second, and ``cuda:2`` an error naming how many there are."""
    monkeypatch.delenv("LOCALTINKER_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"'cuda:2': this machine has 2 CUDA device\(s\)"):
        resolve_device("cuda:2")
    with pytest.raises(ValueError, match="'cuda:x' is not one of"):
        resolve_device("cuda:x")


CARDS = [  # (name, compute capability, default dtype, flash kernels, Triton)
    ("NVIDIA H100 80GB HBM3", (9, 0), "bfloat16", True, True),
    ("NVIDIA GeForce RTX 3090", (8, 6), "bfloat16", True, True),
    ("NVIDIA A100-SXM4-80GB", (8, 0), "bfloat16", True, True),
    ("Tesla T4", (7, 5), "float32", False, True),
    ("Tesla V100-SXM2-32GB", (7, 0), "float32", False, True),
    ("NVIDIA GeForce GTX 1080", (6, 1), "float32", False, False),
]


def _fake_card(monkeypatch: pytest.MonkeyPatch, name: str, capability: tuple[int, int]) -> torch.device:
    """A machine with one CUDA card of ``capability`` (faked: the decisions read no more than these)."""
    monkeypatch.delenv("LOCALTINKER_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return torch.device("cuda", 0)


@pytest.mark.parametrize(("name", "capability", "dtype", "flash", "triton"), CARDS, ids=[c[0] for c in CARDS])
def test_each_card_generation_gets_the_dtype_and_kernels_it_runs(monkeypatch, tmp_path, name, capability, dtype,
                                                                  flash, triton) -> None:
    """bf16 by default only where the card has bf16 tensor cores (sm80 on); packed rows take the flash varlen
    kernel only where torch's flash kernels run (sm80 on), else sdpa per row; the pieces compile only where Triton
    runs (sm70 on), else say why. The CLI, the resource's embedded server and grouped expert GEMMs follow."""
    cuda = _fake_card(monkeypatch, name, capability)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(decode_layer.importlib.util, "find_spec",  # Triton "installed"
                        lambda module, *args: object() if module == "triton" else real_find_spec(module, *args))
    monkeypatch.delenv(TRAIN_COMPILE_ENV, raising=False)
    assert default_dtype(cuda) == dtype
    assert parse_args(["serve", "--storage", str(tmp_path), "--device", "cuda"]).dtype == dtype
    assert build_engine(tmp_path, dtype="auto", device="cuda").dtype == dtype
    assert varlen_available(cuda) is flash
    assert grouped_possible(cuda, torch.bfloat16) is (dtype == "bfloat16")
    compiled, why_not = compile_by_default(cuda, TRAIN_COMPILE_ENV)
    assert compiled is triton
    assert why_not is None if triton else why_not == "Triton does not run on compute capability 6.1 (it needs 7.0)"
    summary = card_summary(cuda)
    assert summary.startswith(f"{name}, sm{capability[0]}{capability[1]}")
    assert ("without" in summary) is (dtype == "float32")
    assert ("Triton" in summary) is not triton
    assert describe_device(cuda) == f"cuda:0 = {summary}" and describe_device(torch.device("cpu")) == "cpu"


def test_bf16_asked_for_on_a_card_without_bf16_tensor_cores_is_allowed_with_a_warning(monkeypatch, tmp_path,
                                                                                      caplog) -> None:
    _fake_card(monkeypatch, "Tesla T4", (7, 5))
    with caplog.at_level(logging.WARNING, logger="localtinker"):
        engine = build_engine(tmp_path, dtype="bfloat16", device="cuda")
    assert engine.dtype == "bfloat16"
    assert "compute capability 7.5, which has no bf16 tensor cores" in caplog.text
    assert "--dtype float32" in caplog.text
    caplog.clear()
    _fake_card(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    with caplog.at_level(logging.WARNING, logger="localtinker"):
        build_engine(tmp_path / "a100", dtype="bfloat16", device="cuda")
    assert "tensor cores" not in caplog.text
    assert dtype_warning(torch.device("cpu"), "bfloat16") is None
    assert card_summary(torch.device("cpu")) == ""


def _card_switches(monkeypatch: pytest.MonkeyPatch, cards: int = 2) -> list[int]:
    """A machine of ``cards`` cards whose current device is per thread, as CUDA's is (faked: the switch reads and
    sets no more); returns the log of set_device calls."""
    _fake_card(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cards)
    current = threading.local()
    switches: list[int] = []

    def set_device(device) -> None:
        index = device.index if isinstance(device, torch.device) else device
        switches.append(index)
        current.index = index

    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(current, "index", 0))
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    return switches


def test_engine_calls_make_the_engines_card_current_in_whichever_thread_they_run(monkeypatch, tmp_path) -> None:
    """CUDA's current device is per thread and starts at card 0 (the protocol's worker thread too): an engine on
    cuda:1 makes card 1 current for each call's duration (graph captures, events and new streams take it), then
    gives the thread back its own, also when the call fails; nested calls keep it; the CPU switches nothing."""
    switches = _card_switches(monkeypatch)
    engine = LocalEngine(tmp_path, dtype="bfloat16", device="cuda:1")
    seen: dict[str, int] = {}

    def call_from_a_new_thread() -> None:
        try:
            with engine._lock:
                with engine._lock:  # re-entrant, as engine methods calling each other
                    seen["nested"] = torch.cuda.current_device()
                seen["inside"] = torch.cuda.current_device()
            engine.forward_backward("no-such-model", [], "cross_entropy", None, False)
        except EngineUserError as error:
            seen["error"] = str(error)
        seen["after"] = torch.cuda.current_device()

    worker = threading.Thread(target=call_from_a_new_thread)
    worker.start()
    worker.join()
    assert seen["nested"] == seen["inside"] == 1
    assert "no-such-model" in seen["error"] and seen["after"] == 0
    assert switches == [1, 1, 1, 0, 1, 0]  # enter, nested enter and exit, exit; the failing call's enter and exit
    assert engine._lock._lock.acquire(blocking=False)  # released after the failure
    engine._lock._lock.release()
    del switches[:]
    with DeviceLock(torch.device("cpu")), device_scope(torch.device("cpu")):
        pass
    assert switches == []


def test_the_sample_streams_steps_run_with_the_engines_card_current(monkeypatch) -> None:
    """The protocol's worker steps the engine's sample stream outside the engine's lock: the step itself makes
    the engine's card current (a decode graph's capture, the event that the sampled tokens' copy has landed)."""
    _card_switches(monkeypatch)
    seen = []

    class Stream:
        busy = True

        def step(self) -> list:
            seen.append(torch.cuda.current_device())
            return []

    stream = RoutedSampleStream(Stream(), Stream(), lambda sampler_id: True, torch.device("cuda", 1))
    stream.step()
    assert seen == [1, 1] and torch.cuda.current_device() == 0
