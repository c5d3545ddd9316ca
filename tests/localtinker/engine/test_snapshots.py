"""The snapshot store: newest in memory within the budget, oldest spilled to disk, a model's oldest dropped."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from localtinker.engine import merged_lora
from localtinker.engine.api import LoraSpec, SampleSpec, UnknownModelError
from localtinker.engine.snapshots import SnapshotStore
from tests.localtinker.engine.reference import TINY
from tests.localtinker.engine.test_checkpoints import train_steps

LAYOUT = {"rank": 2, "seed": 0}


def weights(value: float, size: int = 256) -> dict[str, torch.Tensor]:
    """A snapshot of ``size`` float32 values (1 KiB for the default size)."""
    return {"a": torch.full((size // 2,), float(value)), "b": torch.full((size // 2,), -float(value))}


def files(store: SnapshotStore) -> list[str]:
    return sorted(path.name for path in store.directory.iterdir())


def test_snapshots_stay_in_memory_within_the_budget(tmp_path):
    store = SnapshotStore(tmp_path, per_model=8, memory_bytes=4096)
    numbers = [store.add("m", version, weights(version), LAYOUT) for version in range(4)]
    assert all(store.in_memory(number) for number in numbers) and files(store) == []
    loaded, layout = store.load(numbers[2])
    assert torch.equal(loaded["a"], weights(2)["a"]) and layout == LAYOUT
    assert store.find("m", 3) == numbers[3] and store.find("m", 9) is None and store.find("other", 3) is None


def test_beyond_the_budget_the_oldest_spill_to_disk_and_load_back_equal(tmp_path):
    store = SnapshotStore(tmp_path, per_model=8, memory_bytes=2048)  # two 1 KiB snapshots
    numbers = [store.add(model, version, weights(version + 10 * index), LAYOUT)
               for index, model in enumerate(("m", "n")) for version in range(3)]
    assert [store.in_memory(number) for number in numbers] == [False, False, False, False, True, True]
    assert files(store) == [f"{number}.pt" for number in sorted(numbers[:4])]  # no partial file left
    for index, number in enumerate(numbers):
        loaded, _ = store.load(number)
        expected = weights(index % 3 + 10 * (index // 3))
        assert all(torch.equal(loaded[key], expected[key]) for key in expected)


def test_the_newest_snapshot_stays_in_memory_even_alone_over_the_budget(tmp_path):
    store = SnapshotStore(tmp_path, per_model=8, memory_bytes=0)
    first = store.add("m", 0, weights(1), LAYOUT)
    second = store.add("m", 1, weights(2), LAYOUT)
    assert not store.in_memory(first) and store.in_memory(second)


def test_a_models_oldest_snapshots_are_dropped_with_their_files_and_a_clear_error(tmp_path):
    store = SnapshotStore(tmp_path, per_model=2, memory_bytes=0)
    other = store.add("other", 0, weights(7), LAYOUT)
    numbers = [store.add("m", version, weights(version), LAYOUT) for version in range(4)]
    assert numbers[0] not in store and numbers[1] not in store and numbers[2] in store and other in store
    with pytest.raises(UnknownModelError, match="superseded by 2 newer ones"):
        store.load(numbers[0])
    assert files(store) == sorted(f"{number}.pt" for number in (other, numbers[2]))


def test_directories_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{dead.stdout.strip()}-abc"
    stale.mkdir(parents=True)
    (stale / "1.pt").write_bytes(b"x")
    live = tmp_path / f"{os.getpid()}-keep"
    live.mkdir()
    store = SnapshotStore(tmp_path, per_model=8, memory_bytes=0)
    assert not stale.exists() and live.exists() and store.directory.parent == tmp_path


def test_the_engine_samples_a_spilled_snapshot_as_it_sampled_it_in_memory(engine, new_id):
    """An engine whose budget holds no snapshot but the newest: the older sampling clients read their weights
    back from disk and draw the same tokens with the same logprobs as before the spill."""
    engine.snapshots.memory_bytes = 0
    model_id = new_id()
    engine.create_model(model_id, TINY, LoraSpec(rank=4, seed=0))
    prompt = SampleSpec(prompt_tokens=(3, 4, 5), max_tokens=4, temperature=0.0, stop_token_ids=())
    before = []
    for step in range(3):
        train_steps(engine, model_id, [step])
        engine.create_ephemeral_sampler(f"{model_id}-{step}", model_id)
        before.append(engine.sample_batch([(f"{model_id}-{step}", prompt)])[0].sequences[0])
    numbers = [engine._sampler(f"{model_id}-{step}").snapshot for step in range(3)]
    assert [engine.snapshots.in_memory(number) for number in numbers] == [False, False, True]
    for host in engine._hosts.values():  # evict the resident adapters: the next use imports from the store
        for key in list(host.resident):
            name = host.resident.pop(key)
            if host.merged.pop(name, False) is None:
                merged_lora.unmerge(host.base.model, name)
            host.adapters.delete_adapter(name)
    after = engine.sample_batch([(f"{model_id}-{step}", prompt) for step in range(3)])
    for was, result in zip(before, after):
        assert result.sequences[0].tokens == was.tokens
        assert np.allclose(result.sequences[0].logprobs, was.logprobs, atol=1e-6)
    assert len({tuple(s.tokens) + tuple(np.round(s.logprobs, 4)) for s in before}) == 3  # three distinct weights


def test_an_unchanged_model_reuses_its_snapshot(engine, new_id):
    model_id = new_id()
    engine.create_model(model_id, TINY, LoraSpec(rank=2, seed=0))
    train_steps(engine, model_id, [1])
    engine.create_ephemeral_sampler("first", model_id)
    engine.create_ephemeral_sampler("second", model_id)
    assert engine._sampler("first").snapshot == engine._sampler("second").snapshot
    train_steps(engine, model_id, [2])
    engine.create_ephemeral_sampler("third", model_id)
    assert engine._sampler("third").snapshot != engine._sampler("first").snapshot


def test_a_snapshot_that_cannot_be_spilled_stays_in_memory(tmp_path, monkeypatch):
    """A full disk exceeds the budget instead of failing the sampling client's creation, and leaves no partial file."""
    store = SnapshotStore(tmp_path, per_model=8, memory_bytes=0)
    first = store.add("m", 0, weights(1), LAYOUT)

    def full_disk(obj, path):
        open(path, "wb").write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    second = store.add("m", 1, weights(2), LAYOUT)
    assert store.in_memory(first) and store.in_memory(second) and files(store) == []
    assert torch.equal(store.load(first)[0]["a"], weights(1)["a"])
