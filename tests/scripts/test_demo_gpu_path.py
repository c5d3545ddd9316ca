"""scripts/demo_gpu_path.py: the embedded server it starts runs the GPU's code path (the portable engine in bf16,
written-out training layers, static decoder) on this machine's device."""

from __future__ import annotations

from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def test_the_demos_engine_is_the_gpus_code_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import demo_gpu_path

    engine = demo_gpu_path.portable_engine(tmp_path, dtype="float32", device="cpu")
    assert (engine.portable, engine.static_decode, engine.train_layers, engine.dtype) == (True, True, True, "bfloat16")
    assert engine.device == torch.device("cpu")
