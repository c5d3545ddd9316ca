"""Checkpoints on disk under the server's storage directory, addressed by ``tinker://`` paths.

``tinker://<run_id>/weights/<name>`` holds LoRA weights + Adam moments + step (training state);
``tinker://<run_id>/sampler_weights/<name>`` holds LoRA weights only. ``run_id`` is the training
model id (``<session>:train:<n>``), exactly what the SDK's ``ParsedCheckpointTinkerPath`` reads back
as ``training_run_id``. Layout: ``<root>/<quoted run_id>/<kind>/<name>/{adapter,optimizer}.safetensors,
meta.json``. Each checkpoint is written into a temporary sibling directory and renamed into place, so
a crash never leaves a half checkpoint and everything survives a server restart.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

import torch
from safetensors.torch import load_file, save_file

from localtinker.engine.api import CheckpointInfo, EngineUserError, UnknownModelError

KINDS = ("weights", "sampler_weights")
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
            f"checkpoint path {path!r} must look like tinker://<run_id>/weights/<name> or "
            "tinker://<run_id>/sampler_weights/<name>."
        )
    return parts[0], parts[1], parts[2]


def validate_name(name: str) -> None:
    if not isinstance(name, str) or not name or "/" in name or name.startswith(".") or len(name) > 200:
        raise EngineUserError(
            f"checkpoint name {name!r} must be non-empty, at most 200 characters, without '/' and not start with '.'."
        )


class CheckpointStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

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
    ) -> str:
        validate_name(name)
        target = self._dir(run_id, kind, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
        try:
            save_file({k: v.contiguous() for k, v in adapter.items()}, str(staging / _ADAPTER_FILE))
            if optimizer is not None:
                save_file({k: v.contiguous() for k, v in optimizer.items()}, str(staging / _OPTIMIZER_FILE))
            full_meta = {**meta, "run_id": run_id, "kind": kind, "name": name, "created_at": time.time()}
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

    def load(self, path: str) -> LoadedCheckpoint:
        run_id, kind, name = parse_tinker_path(path)
        directory = self._dir(run_id, kind, name)
        if not (directory / _META_FILE).is_file():
            raise UnknownModelError(f"checkpoint {path} does not exist; list_checkpoints shows the saved ones.")
        meta = json.loads((directory / _META_FILE).read_text())
        adapter = load_file(str(directory / _ADAPTER_FILE))
        optimizer_file = directory / _OPTIMIZER_FILE
        optimizer = load_file(str(optimizer_file)) if optimizer_file.is_file() else None
        return LoadedCheckpoint(meta=meta, adapter=adapter, optimizer=optimizer)

    def list(self, run_id: str | None = None) -> list[CheckpointInfo]:
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
                        )
                    )
        return sorted(infos, key=lambda info: info.created_at)

    def delete(self, path: str) -> None:
        run_id, kind, name = parse_tinker_path(path)
        directory = self._dir(run_id, kind, name)
        if not directory.is_dir():
            raise UnknownModelError(f"checkpoint {path} does not exist; nothing to delete.")
        trash = directory.parent / f".{name}.deleted-{os.getpid()}-{time.monotonic_ns()}"
        directory.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
    for file in directory.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
