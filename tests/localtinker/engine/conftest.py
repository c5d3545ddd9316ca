"""Engine fixtures: one float32 engine on the tiny model per test module, fresh model ids per test."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from localtinker.engine.engine import LocalEngine

_ids = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    """Tiny-model matmuls gain nothing from 2 threads and lose ~7x when the 2 cores are shared by other jobs."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def engine_storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-storage")


@pytest.fixture(scope="module")
def engine(engine_storage: Path) -> LocalEngine:
    return LocalEngine(engine_storage, dtype="float32")


@pytest.fixture
def new_id():
    """Returns a factory of unique ``<session>:train:<n>`` model ids."""
    return lambda kind="train": f"test-session:{kind}:{next(_ids)}"


@pytest.fixture(scope="module")
def tokenizer_for_tiny():
    from transformers import AutoTokenizer

    from localtinker.engine.models import tiny_random_dir

    return AutoTokenizer.from_pretrained(tiny_random_dir())
