"""Device selection: auto | cpu | cuda[:N], from the caller or $LOCALTINKER_DEVICE, with clear errors."""

from __future__ import annotations

import pytest
import torch

from localtinker.engine.device import resolve_device
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
