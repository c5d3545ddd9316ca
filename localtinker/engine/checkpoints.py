"""Checkpoints on disk under the server's storage directory, addressed by ``tinker://`` paths.

``tinker://<run_id>/weights/<name>`` holds LoRA weights + Adam moments + step (training state);
``tinker://<run_id>/sampler_weights/<name>`` holds LoRA weights only;
``tinker://<run_id>/external_weights/<name>`` holds the LoRA weights in PEFT's format for download
(``peft_export.py``; served through signed URLs, never loaded back). ``run_id`` is the training
model id (``<session>:train:<n>``), exactly what the SDK's ``ParsedCheckpointTinkerPath`` reads back
as ``training_run_id``. Layout: ``<root>/<quoted run_id>/<kind>/<name>/{adapter,optimizer}.safetensors,
meta.json``. Each checkpoint is written into a temporary sibling directory and renamed into place, so
a crash never leaves a half checkpoint and everything survives a server restart.

A checkpoint saved with ``ttl_seconds`` records ``expires_at`` in its meta; expired checkpoints are
deleted whenever the store saves, lists or loads, and loading one fails with "expired" (as hosted
Tinker deletes them), so the storage directory does not grow without bound in long runs. A save scans
the directory only when the earliest expiry the store knows of has passed (one scan at start-up finds
them): an RL loop saves a sampler checkpoint per step, and a scan per save would read every checkpoint's
meta. The store assumes it is the only writer of its directory.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

import torch
from safetensors.torch import load_file, save_file

from localtinker.engine.api import (
    CheckpointInfo,
    EngineUserError,
    UnknownModelError,
    checkpoint_ttl_problem,
)

KINDS = ("weights", "sampler_weights", "external_weights")
LOADABLE_KINDS = ("weights", "sampler_weights")  # external weights are a download format
_ADAPTER_FILE = "adapter.safetensors"
_OPTIMIZER_FILE = "optimizer.safetensors"
_META_FILE = "meta.json"


@dataclass
class LoadedCheckpoint:
    meta: dict
    adapter: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor] | None


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """``tinker://<run_id>/<kind>/<name>`` → (run_id, kind, name); same split as the SDK's parser."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise EngineUserError(f"checkpoint path {path!r} must look like tinker://<run_id>/weights/<name>.")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not all(parts):
        raise EngineUserError(
            f"checkpoint path {path!r} must look like tinker://<run_id>/weights/<name>, "
            "tinker://<run_id>/sampler_weights/<name> or tinker://<run_id>/external_weights/<name>."
        )
    return parts[0], parts[1], parts[2]


def validate_name(name: str) -> None:
    if not isinstance(name, str) or not name or "/" in name or name.startswith(".") or len(name) > 200:
        raise EngineUserError(
            f"checkpoint name {name!r} must be non-empty, at most 200 characters, without '/' and not start with '.'."
        )


def _check_ttl(ttl_seconds: int | None) -> None:
    problem = checkpoint_ttl_problem(ttl_seconds)
    if problem is not None:
        raise EngineUserError(problem)


class CheckpointStore:
    def __init__(self, root: Path, clock: Callable[[], float] = time.time) -> None:
        """``clock`` gives the current unix time (tests pass a fake one to expire checkpoints)."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self._scanned = False  # purge_expired has scanned once, so _next_expiry covers every checkpoint
        self._next_expiry: float | None = None  # the earliest expires_at of a live checkpoint, None: none expires

    def _dir(self, run_id: str, kind: str, name: str) -> Path:
        return self.root / quote(run_id, safe="") / kind / name

    def save(
        self,
        run_id: str,
        kind: str,
        name: str,
        adapter: dict[str, torch.Tensor],
        meta: dict,
        optimizer: dict[str, torch.Tensor] | None = None,
        ttl_seconds: int | None = None,
    ) -> str:
        def write(staging: Path) -> None:
            save_file({k: v.contiguous() for k, v in adapter.items()}, str(staging / _ADAPTER_FILE))
            if optimizer is not None:
                save_file({k: v.contiguous() for k, v in optimizer.items()}, str(staging / _OPTIMIZER_FILE))

        return self.save_files(run_id, kind, name, write, meta, ttl_seconds)

    def save_files(
        self, run_id: str, kind: str, name: str, write: Callable[[Path], None], meta: dict, ttl_seconds: int | None
    ) -> str:
        """Saves a checkpoint whose files ``write(staging_dir)`` puts in place; atomic like every save."""
        validate_name(name)
        _check_ttl(ttl_seconds)
        self.purge_expired()
        target = self._dir(run_id, kind, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
        try:
            write(staging)
            now = self.clock()
            expires_at = None if ttl_seconds is None else now + ttl_seconds
            self._expires(expires_at)
            full_meta = {**meta, "run_id": run_id, "kind": kind, "name": name, "created_at": now, "expires_at": expires_at}
            (staging / _META_FILE).write_text(json.dumps(full_meta, indent=1))
            _fsync_dir(staging)
            if target.exists():
                trash = target.parent / f".{name}.old-{os.getpid()}-{time.monotonic_ns()}"
                target.rename(trash)
                staging.rename(target)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return f"tinker://{run_id}/{kind}/{name}"

    def files(self, path: str) -> tuple[dict[str, Path], dict]:
        """A live checkpoint's files (name -> absolute path, meta excluded) and its meta."""
        meta = self.meta(path)
        directory = self._dir(*parse_tinker_path(path))
        files = {f.name: f for f in sorted(directory.iterdir()) if f.is_file() and f.name != _META_FILE}
        return files, meta

    def meta(self, path: str) -> dict:
        """The checkpoint's meta (base model, LoRA config, step, times) without reading its tensors."""
        run_id, kind, name = parse_tinker_path(path)
        directory = self._dir(run_id, kind, name)
        if not (directory / _META_FILE).is_file():
            raise UnknownModelError(f"checkpoint {path} does not exist; list_checkpoints shows the saved ones.")
        meta = json.loads((directory / _META_FILE).read_text())
        if self._expired(meta):
            self._remove(directory)
            raise UnknownModelError(
                f"checkpoint {path} expired at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(meta['expires_at']))} "
                "(its ttl_seconds) and was deleted; save checkpoints you need without a TTL."
            )
        return meta

    def load(self, path: str) -> LoadedCheckpoint:
        run_id, kind, name = parse_tinker_path(path)
        if kind not in LOADABLE_KINDS:
            raise EngineUserError(
                f"{path} holds weights exported for download (PEFT format), which are not loaded back; use the "
                f"training checkpoint it was saved from (tinker://{run_id}/weights/<name>) or a sampler_weights path."
            )
        meta = self.meta(path)
        directory = self._dir(run_id, kind, name)
        adapter = load_file(str(directory / _ADAPTER_FILE))
        optimizer_file = directory / _OPTIMIZER_FILE
        optimizer = load_file(str(optimizer_file)) if optimizer_file.is_file() else None
        return LoadedCheckpoint(meta=meta, adapter=adapter, optimizer=optimizer)

    def list(self, run_id: str | None = None) -> list[CheckpointInfo]:
        """Live checkpoints, oldest first; expired ones are deleted on the way."""
        return [info for info in self._scan(run_id) if not self._remove_if_expired(info)]

    def purge_expired(self) -> None:
        """Deletes expired checkpoints; scans the directory only when one may have expired since the last scan."""
        if self._scanned and (self._next_expiry is None or self._next_expiry > self.clock()):
            return
        live = [info for info in self._scan(None) if not self._remove_if_expired(info)]
        expiries = [info.expires_at for info in live if info.expires_at is not None]
        self._next_expiry, self._scanned = (min(expiries) if expiries else None), True

    def _expires(self, expires_at: float | None) -> None:
        """Notes a checkpoint that expires at ``expires_at`` (None: never)."""
        if expires_at is not None and (self._next_expiry is None or expires_at < self._next_expiry):
            self._next_expiry = expires_at

    def set_ttl(self, path: str, ttl_seconds: int | None) -> CheckpointInfo:
        """Expires ``path`` ``ttl_seconds`` from now (None: never); rewrites its meta atomically."""
        _check_ttl(ttl_seconds)
        expires_at = None if ttl_seconds is None else self.clock() + ttl_seconds
        self._expires(expires_at)
        return self._update_meta(path, {"expires_at": expires_at})

    def set_public(self, path: str, public: bool) -> CheckpointInfo:
        """Marks ``path`` published or not (idempotent)."""
        return self._update_meta(path, {"public": public})

    def _update_meta(self, path: str, changes: dict) -> CheckpointInfo:
        run_id, kind, name = parse_tinker_path(path)
        meta_file = self._dir(run_id, kind, name) / _META_FILE
        if not meta_file.is_file() or self._expired(json.loads(meta_file.read_text())):
            self.purge_expired()
            raise UnknownModelError(f"checkpoint {path} does not exist (or has expired); list_checkpoints shows the live ones.")
        meta = {**json.loads(meta_file.read_text()), **changes}
        staging = meta_file.with_name(f".{_META_FILE}.{os.getpid()}-{time.monotonic_ns()}")
        staging.write_text(json.dumps(meta, indent=1))
        os.replace(staging, meta_file)
        return next(info for info in self._scan(run_id) if info.tinker_path == path)

    def _expired(self, meta: dict) -> bool:
        expires_at = meta.get("expires_at")
        return expires_at is not None and float(expires_at) <= self.clock()

    def _remove_if_expired(self, info: CheckpointInfo) -> bool:
        if info.expires_at is None or info.expires_at > self.clock():
            return False
        self._remove(self._dir(info.run_id, info.kind, info.name))
        return True

    def _scan(self, run_id: str | None) -> list[CheckpointInfo]:
        run_dirs = [self.root / quote(run_id, safe="")] if run_id is not None else sorted(self.root.iterdir())
        infos = []
        for run_dir in run_dirs:
            if not run_dir.is_dir() or run_dir.name.startswith("."):
                continue
            for kind in KINDS:
                kind_dir = run_dir / kind
                if not kind_dir.is_dir():
                    continue
                for checkpoint in sorted(kind_dir.iterdir()):
                    meta_file = checkpoint / _META_FILE
                    if checkpoint.name.startswith(".") or not meta_file.is_file():
                        continue
                    meta = json.loads(meta_file.read_text())
                    run = unquote(run_dir.name)
                    infos.append(
                        CheckpointInfo(
                            tinker_path=f"tinker://{run}/{kind}/{checkpoint.name}",
                            run_id=run,
                            kind=kind,
                            name=checkpoint.name,
                            created_at=float(meta.get("created_at", 0.0)),
                            size_bytes=sum(f.stat().st_size for f in checkpoint.iterdir() if f.is_file()),
                            expires_at=None if meta.get("expires_at") is None else float(meta["expires_at"]),
                            public=bool(meta.get("public", False)),
                        )
                    )
        return sorted(infos, key=lambda info: info.created_at)

    def delete(self, path: str) -> None:
        run_id, kind, name = parse_tinker_path(path)
        directory = self._dir(run_id, kind, name)
        if not directory.is_dir():
            raise UnknownModelError(f"checkpoint {path} does not exist; nothing to delete.")
        self._remove(directory)

    def _remove(self, directory: Path) -> None:
        """Renames first so a concurrent reader sees the checkpoint either whole or gone."""
        trash = directory.parent / f".{directory.name}.deleted-{os.getpid()}-{time.monotonic_ns()}"
        try:
            directory.rename(trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
    for file in directory.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
