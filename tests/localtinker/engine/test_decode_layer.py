"""decode_layer.py's choice of compiling the layer pieces, on a CUDA device as the decision sees one (the
pieces' values are checked against transformers' layers in test_static_decode.py and test_packed_layers.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from localtinker.engine import decode_layer
from localtinker.engine.decode_layer import COMPILE_ENV, TRAIN_COMPILE_ENV, compile_by_default


@pytest.mark.parametrize("env", [COMPILE_ENV, TRAIN_COMPILE_ENV])
def test_pieces_compile_on_cuda_with_triton_and_say_why_not_elsewhere(monkeypatch, env):
    """Compiled on a CUDA device where Triton imports; each other case names its reason (the engine reports it
    as ``compile_error``): the CPU, a CUDA torch without Triton, and the variable set to 0. Set to 1, it compiles
    on the CPU too (inductor's C++), not on a CUDA device without Triton."""
    real_find_spec = importlib.util.find_spec
    triton = {"installed": True}

    def find_spec(name, *args):
        if name == "triton":
            return object() if triton["installed"] else None
        return real_find_spec(name, *args)

    monkeypatch.setattr(decode_layer.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # (older: test_device.py)
    monkeypatch.delenv(env, raising=False)
    cuda = torch.device("cuda", 0)
    assert compile_by_default(cuda, env) == (True, None)
    assert compile_by_default(torch.device("cpu"), env) == (False, "not compiled on cpu")
    triton["installed"] = False
    assert compile_by_default(cuda, env) == (False, "Triton is not installed")
    triton["installed"] = True
    monkeypatch.setenv(env, "0")
    assert compile_by_default(cuda, env) == (False, f"{env}=0")
    monkeypatch.setenv(env, "1")
    assert compile_by_default(torch.device("cpu"), env) == (True, None)
    assert compile_by_default(cuda, env) == (True, None)
    triton["installed"] = False
    assert compile_by_default(cuda, env) == (False, "Triton is not installed")
