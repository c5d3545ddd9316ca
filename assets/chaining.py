"""``init_from``: which checkpoint a training run starts from, named the way a user names it.

Accepted references (every training asset's ``init_from`` field):
- empty: a fresh LoRA on the base model;
- ``tinker://<run>/weights/<name>`` (or its ``sampler_weights`` twin when it belongs to a registered checkpoint);
- a checkpoint partition key, e.g. ``sft-1a2b3c4d-000040``;
- ``latest:<recipe>``: that recipe's newest registered checkpoint;
- ``best:<recipe>`` / ``latest-evaluated:<recipe>``: the version behind that MLflow alias of the recipe's
  registered model (``best`` = highest held-out task score, kept by the eval reports);
- ``<registered model>/<version>``.
A reference that names a registered checkpoint resolves to its manifest, so lineage follows the chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from assets.checkpoint_manifest import CheckpointManifest, all_manifests, find_manifest
from resources.mlflow import ALIAS_BEST, ALIAS_LATEST

ALIAS_PREFIXES = {"best": ALIAS_BEST, "latest-evaluated": ALIAS_LATEST}


class InitFromError(ValueError):
    """``init_from`` names nothing that exists, or something incompatible with this run."""


@dataclass(frozen=True)
class ParentCheckpoint:
    state_path: str
    manifest: CheckpointManifest | None  # None: a raw tinker:// path that no registered checkpoint owns

    @property
    def partition(self) -> str | None:
        return self.manifest.partition if self.manifest else None

    @property
    def sampler_path(self) -> str | None:
        """The parent's sampler weights (the RL recipes' KL reference); None for a raw path no manifest owns."""
        return self.manifest.sampler_path if self.manifest else None

    def describe(self) -> str:
        return f"{self.partition} ({self.state_path})" if self.manifest else self.state_path


def resolve_init_from(
    reference: str, *, alias_lookup: Callable[[str, str], str] | None = None, base_model: str | None = None
) -> ParentCheckpoint | None:
    """The checkpoint ``reference`` names (None for the base model); see the module docstring.

    ``alias_lookup(registered_model, alias) -> partition key`` resolves MLflow aliases. With
    ``base_model``, a parent trained on another base model is refused.
    """
    reference = reference.strip()
    if not reference:
        return None
    parent = _resolve(reference, alias_lookup)
    if base_model and parent.manifest and parent.manifest.base_model != base_model:
        raise InitFromError(
            f"init_from={reference!r} is a checkpoint of {parent.manifest.base_model!r}, but this run trains "
            f"{base_model!r}: materialize base_model with {parent.manifest.base_model!r}, or pick a checkpoint of {base_model!r}"
        )
    if not parent.state_path:
        raise InitFromError(f"init_from={reference!r}: checkpoint {parent.describe()} has no saved training state to start from")
    return parent


def _resolve(reference: str, alias_lookup) -> ParentCheckpoint:
    prefix, _, recipe = reference.partition(":")
    if prefix == "latest" and recipe:
        candidates = [m for m in all_manifests() if m.recipe == recipe]
        if not candidates:
            raise InitFromError(
                f"init_from={reference!r}: no {recipe} checkpoint is registered yet; run the {recipe} training job first"
            )
        newest = max(candidates, key=lambda m: (int(m.model_version or 0), m.step))
        return ParentCheckpoint(newest.state_path or "", newest)
    if prefix in ALIAS_PREFIXES and recipe:
        if alias_lookup is None:
            raise InitFromError(f"init_from={reference!r} needs MLflow to resolve the alias; none is configured")
        try:
            partition = alias_lookup(recipe, ALIAS_PREFIXES[prefix])
        except LookupError as error:
            raise InitFromError(f"init_from={reference!r}: {error}") from error
        manifest = find_manifest(partition)
        return ParentCheckpoint(manifest.state_path or "", manifest)
    try:
        manifest = find_manifest(reference)
    except LookupError:
        if reference.startswith("tinker://"):
            if "/sampler_weights/" in reference:
                raise InitFromError(
                    f"init_from={reference!r} is sampler weights (no optimizer-compatible state): "
                    "pass the tinker://.../weights/<name> state path"
                ) from None
            return ParentCheckpoint(reference, None)
        raise InitFromError(
            f"init_from={reference!r} names no checkpoint: use a tinker:// state path, a checkpoint partition key "
            "(`python -m pipelines lineage --list`), latest:<recipe>, best:<recipe>, or <registered model>/<version>"
        ) from None
    return ParentCheckpoint(manifest.state_path or "", manifest)


@dataclass(frozen=True)
class SamplerModel:
    """A model to sample or score with: a checkpoint's sampler weights, or the base model itself."""

    base_model: str
    sampler_path: str | None  # None: the base model's own weights
    manifest: CheckpointManifest | None  # the registered checkpoint, when there is one

    @property
    def partition(self) -> str | None:
        return self.manifest.partition if self.manifest else None


def resolve_sampler(
    reference: str,
    *,
    base_model: str,
    what: str,
    alias_lookup: Callable[[str, str], str] | None = None,
    same_base_model: bool = True,
) -> SamplerModel:
    """The sampler weights ``reference`` names (the forms of :func:`resolve_init_from`, or a
    ``tinker://.../sampler_weights/...`` path); empty = ``base_model`` itself. ``what`` names the field in errors.
    ``same_base_model=False`` allows a checkpoint of another base model (a distillation teacher)."""
    reference = reference.strip()
    if not reference:
        return SamplerModel(base_model, None, None)
    if reference.startswith("tinker://") and "/sampler_weights/" in reference:
        try:
            manifest = find_manifest(reference)
        except LookupError:  # an unregistered sampler path: assume the base model, as Tinker would load it
            return SamplerModel(base_model, reference, None)
    else:
        try:
            parent = resolve_init_from(reference, alias_lookup=alias_lookup, base_model=base_model if same_base_model else None)
        except InitFromError as error:
            raise InitFromError(f"{what}: {error}") from error
        if parent is None or parent.manifest is None:
            raise InitFromError(
                f"{what}={reference!r} is an unregistered training state without sampler weights: pass its "
                "tinker://.../sampler_weights/... path or a registered checkpoint (partition key, latest:<recipe>, best:<recipe>)"
            )
        manifest = parent.manifest
    if not manifest.sampler_path:
        raise InitFromError(f"{what}={reference!r}: checkpoint {manifest.partition} has no sampler weights")
    return SamplerModel(manifest.base_model, manifest.sampler_path, manifest)
