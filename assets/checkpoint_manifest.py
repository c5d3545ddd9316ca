"""One JSON file per checkpoint partition: what the checkpoint is and everything it came from.

The training asset writes ``<state>/checkpoints/<partition>.json`` *before* it adds the partition, so
whoever sees a partition of ``checkpoints`` (the eval sensor, an eval run in another process, the
lineage command) can read the checkpoint's ``tinker://`` paths and lineage by the partition key alone,
never by guessing "the newest file".
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from posttrain.atomic_files import write_text_atomically
from resources.state import state_subdir


@dataclass
class CheckpointManifest:
    partition: str
    recipe: str
    name: str
    step: int
    epoch: int | None
    final: bool
    state_path: str | None
    sampler_path: str | None
    base_model: str
    base_model_digest: str
    renderer: str
    training_dagster_run_id: str
    training_asset: str
    log_dir: str
    mlflow_run_id: str
    mlflow_run_url: str
    registered_model: str
    model_version: str
    upstream: dict[str, dict[str, Any]] = field(default_factory=dict)  # asset key -> {data_version, run_id, ...}
    # Chaining: the tinker:// state training started from, and the checkpoint partition it names (None: base model).
    init_from: str | None = None
    parent_partition: str | None = None
    tokenizer: str = ""  # identity of the tokenizer the training tokens were rendered with
    mlflow_model_id: str = ""  # the MLflow 3 logged model of this checkpoint
    related: dict[str, Any] = field(default_factory=dict)  # recipe-specific lineage: reference, teachers, sampler...

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def manifests_dir() -> Path:
    return state_subdir("checkpoints")


def manifest_path(partition: str) -> Path:
    return manifests_dir() / f"{partition}.json"


def write_manifest(manifest: CheckpointManifest) -> Path:
    """Atomic write (temp + rename): a reader never sees half a manifest; rewriting the same one is a no-op."""
    path = manifest_path(manifest.partition)
    if path.exists() and json.loads(path.read_text()) == manifest.to_json():
        return path
    write_text_atomically(path, json.dumps(manifest.to_json(), indent=2))
    return path


def read_manifest(partition: str) -> CheckpointManifest:
    path = manifest_path(partition)
    if not path.exists():
        raise FileNotFoundError(
            f"no checkpoint manifest {path} for partition {partition!r}: it was made under another "
            "POSTTRAIN_STATE_DIR, or its training run died before registering it (re-execute that training run from failure)."
        )
    return CheckpointManifest(**json.loads(path.read_text()))


def all_manifests() -> list[CheckpointManifest]:
    return [CheckpointManifest(**json.loads(path.read_text())) for path in sorted(manifests_dir().glob("*.json"))]


def find_manifest(reference: str) -> CheckpointManifest:
    """By partition key, ``tinker://`` path (state or sampler) or ``<registered model>/<version>``."""
    for manifest in all_manifests():
        if reference in (
            manifest.partition,
            manifest.state_path,
            manifest.sampler_path,
            f"{manifest.registered_model}/{manifest.model_version}",
        ):
            return manifest
    raise LookupError(
        f"no checkpoint matches {reference!r} in {manifests_dir()}; pass a tinker:// path, "
        "a <registered-model>/<version> or a checkpoints partition key (list them with `python -m pipelines lineage --list`)."
    )
