"""Download a checkpoint's LoRA as a PEFT adapter through the SDK, as ``tinker checkpoint download`` does.

A training checkpoint (``tinker://<run>/weights/<name>``) is loaded into a new training client and exported
with ``save_weights_external`` (a temporary external checkpoint, deleted afterwards); an external-weights path
is downloaded as is. Sampler checkpoints hold no exportable state on hosted Tinker, so they are refused.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import tinker

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TEMPORARY_EXPORT_TTL_S = 3600
_CHUNK = 1 << 20


class ExportError(ValueError):
    """An export that cannot be done as asked; the message says what, where and how to fix it."""


def checkpoint_kind(path: str) -> str:
    try:
        parsed = tinker.ParsedCheckpointTinkerPath.from_tinker_path(path)
    except ValueError as error:
        raise ExportError(
            f"{path!r} is not a checkpoint path; pass tinker://<run>/weights/<name> (from save_state) or "
            "tinker://<run>/external_weights/<name>"
        ) from error
    if parsed.checkpoint_type == "sampler":
        raise ExportError(
            f"{path} is a sampler checkpoint, which cannot be exported; pass the tinker://<run>/weights/<name> "
            "path saved with save_state at the same step (the checkpoint manifest's state_path)"
        )
    return parsed.checkpoint_type


def download_adapter(service: tinker.ServiceClient, rest: tinker.RestClient, path: str, dest: Path) -> None:
    """Writes ``adapter_config.json`` and ``adapter_model.safetensors`` of ``path`` into ``dest``."""
    if checkpoint_kind(path) == "external":
        _download_external(rest, path, dest)
        return
    try:
        trainer = service.create_training_client_from_state(path, user_metadata={"created_by": "posttrain export"}).result()
    except Exception as error:  # noqa: BLE001 - the SDK raises several kinds for a missing checkpoint
        raise ExportError(f"cannot load {path}: {error}. `python -m pipelines lineage --list` shows the known checkpoints") from error
    export = trainer.save_weights_external("posttrain-export", ttl_seconds=TEMPORARY_EXPORT_TTL_S).result().path
    try:
        _download_external(rest, export, dest)
    finally:
        rest.delete_checkpoint_from_tinker_path(export).result()


def _download_external(rest: tinker.RestClient, path: str, dest: Path) -> None:
    signed = rest.get_external_weights_urls(path).result()
    missing = {ADAPTER_CONFIG, ADAPTER_WEIGHTS} - set(signed.urls)
    if missing:
        raise ExportError(f"{path} has no {sorted(missing)}; it is not a LoRA export (files: {sorted(signed.urls)})")
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        _fetch(signed.urls[name], dest / name)


def _fetch(url: str, target: Path) -> None:
    """Streams one file; a short read (a dropped connection) is an error, not a truncated file."""
    with urllib.request.urlopen(url, timeout=60) as response, open(target, "wb") as out:
        expected = int(response.headers.get("Content-Length", -1))
        shutil.copyfileobj(response, out, _CHUNK)
        written = out.tell()
    if expected >= 0 and written != expected:
        raise ExportError(f"download of {target.name} stopped at {written} of {expected} bytes; run the export again")


def adapter_base_model(adapter_dir: Path) -> str:
    return str(json.loads((adapter_dir / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or "")
