"""Snapshots of training weights behind ephemeral sampling clients (``save_weights_and_get_sampling_client``).

An RL loop takes one snapshot per step and samples it at once, so a snapshot is kept in host memory while the
store's memory budget allows: the sampler imports it without a file round trip (``torch.save`` + ``torch.load``
of a 1B model's rank-32 adapter took ~0.15 s of a ~1.2 s GPU GRPO step; docs/localtinker-gpu.md). Beyond the
budget the oldest in-memory snapshots spill to a private directory (so many models' snapshots do not pile up in
RAM), and beyond ``per_model`` snapshots a model's oldest are dropped: a sampling client still pointing at one
gets a clear error.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from localtinker.engine.api import UnknownModelError

logger = logging.getLogger("localtinker.engine")


@dataclass
class _Snapshot:
    number: int
    model_id: str
    version: int
    lora: dict
    nbytes: int
    weights: dict[str, torch.Tensor] | None  # None once spilled to ``file``
    file: Path | None = None


class SnapshotStore:
    """Numbered snapshots, newest in memory up to ``memory_bytes`` in all, the rest on disk under ``root``."""

    def __init__(self, root: Path, per_model: int, memory_bytes: int) -> None:
        self.directory = _fresh_private_dir(root)
        self.per_model = per_model
        self.memory_bytes = memory_bytes
        self._snapshots: OrderedDict[int, _Snapshot] = OrderedDict()  # oldest first
        self._counter = 0

    def find(self, model_id: str, version: int) -> int | None:
        """The number of ``model_id``'s snapshot at weights ``version``, if one is kept (snapshots are reused
        while the weights do not change)."""
        for number, snapshot in self._snapshots.items():
            if snapshot.model_id == model_id and snapshot.version == version:
                return number
        return None

    def add(self, model_id: str, version: int, weights: dict[str, torch.Tensor], lora: dict) -> int:
        """Keeps ``weights`` (CPU tensors the store now owns) as a new snapshot and returns its number."""
        self._counter += 1
        nbytes = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
        self._snapshots[self._counter] = _Snapshot(self._counter, model_id, version, dict(lora), nbytes, weights)
        self._drop_oldest_of(model_id)
        self._spill_beyond_budget()
        return self._counter

    def load(self, number: int) -> tuple[dict[str, torch.Tensor], dict]:
        """The snapshot's weights and LoRA layout; UnknownModelError once it has been dropped."""
        snapshot = self._snapshots.get(number)
        if snapshot is None:
            raise UnknownModelError(
                f"this sampling client's weights snapshot was superseded by {self.per_model} newer ones and "
                "dropped; create a new sampling client (or save_weights_for_sampler to keep weights)."
            )
        if snapshot.weights is not None:
            return snapshot.weights, snapshot.lora
        assert snapshot.file is not None
        return torch.load(snapshot.file, weights_only=True), snapshot.lora

    def in_memory(self, number: int) -> bool:
        snapshot = self._snapshots.get(number)
        return snapshot is not None and snapshot.weights is not None

    def __contains__(self, number: int) -> bool:
        return number in self._snapshots

    def drop_model(self, model_id: str) -> None:
        """Forgets every snapshot of ``model_id`` (a released training model), files included."""
        for number in self._numbers_of(model_id):
            self._drop(number)

    def _numbers_of(self, model_id: str) -> list[int]:
        return [number for number, snapshot in self._snapshots.items() if snapshot.model_id == model_id]

    def _drop_oldest_of(self, model_id: str) -> None:
        for number in self._numbers_of(model_id)[: -self.per_model]:
            self._drop(number)

    def _drop(self, number: int) -> None:
        dropped = self._snapshots.pop(number)
        if dropped.file is not None:
            dropped.file.unlink(missing_ok=True)

    def _spill_beyond_budget(self) -> None:
        """Writes the oldest in-memory snapshots to disk until the rest fit the budget; the newest one always
        stays in memory (it is the one about to be sampled). A snapshot that cannot be written (a full disk)
        stays in memory: the budget is exceeded rather than the request failed."""
        held = [snapshot for snapshot in self._snapshots.values() if snapshot.weights is not None]
        total = sum(snapshot.nbytes for snapshot in held)
        for snapshot in held[:-1]:
            if total <= self.memory_bytes:
                return
            try:
                snapshot.file = self._write(snapshot)
            except OSError as error:
                logger.warning("snapshots: could not spill snapshot %d to %s (%s); keeping it in memory",
                               snapshot.number, self.directory, error)
                return
            snapshot.weights = None
            total -= snapshot.nbytes

    def _write(self, snapshot: _Snapshot) -> Path:
        """Writes under a temporary name and renames, so no reader ever sees a half-written file."""
        file = self.directory / f"{snapshot.number}.pt"
        partial = file.with_suffix(".partial")
        try:
            torch.save(snapshot.weights, partial)
            os.replace(partial, file)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        return file


def _fresh_private_dir(root: Path) -> Path:
    """A snapshot directory private to this process; those of processes that have died are removed."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.iterdir():
        pid = stale.name.split("-")[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root))


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
