"""`python -m pipelines export <ref> --out DIR [--merged] [--gguf]`: a checkpoint out as a PEFT adapter (and a merged
Hugging Face model, and a GGUF file), verified against the server, through the same Tinker resource the recipes use, so a
hosted checkpoint exports exactly as a local one does."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import tinker

from posttrain.export.adapter import ExportError
from resources.hf_export.export import export_checkpoint
from resources.mlflow import MlflowResource
from resources.models import tokenizer_path
from resources.tinker import TinkerResource


def resolve(reference: str) -> tuple[str, str | None, dict]:
    """(tinker path, base model if the manifest knows it, model-card facts) for a path, version or partition."""
    from pipelines.lineage import resolve_reference

    try:
        manifest = resolve_reference(reference, MlflowResource().get_client())
    except LookupError:
        if reference.startswith("tinker://"):
            return reference, None, {}
        raise
    path = manifest.state_path
    if not path:
        raise ExportError(f"checkpoint {manifest.partition} saved no training state (state_path); nothing to export")
    card = {
        "title": f"{manifest.registered_model} v{manifest.model_version}",
        "recipe": manifest.recipe,
        "partition": manifest.partition,
        "registered_model": manifest.registered_model,
        "model_version": manifest.model_version,
        "data_versions": {asset: str(info.get("data_version", "")) for asset, info in manifest.upstream.items()},
    }
    return path, manifest.base_model, card


def _base_model_of(rest: tinker.RestClient, path: str) -> str:
    try:
        return rest.get_weights_info_by_tinker_path(path).result().base_model
    except tinker.APIStatusError as error:
        raise ExportError(
            f"cannot load {path}: {error.message}. `tinker checkpoint list` (or `python -m pipelines lineage --list`) "
            "shows the known checkpoints"
        ) from error


def run_cli(reference: str, out: str, merged: bool, gguf: bool = False) -> int:
    try:
        path, base_model, card = resolve(reference)
        # TINKER_BASE_URL / TINKER_API_KEY point it at a running server (hosted or localtinker), as for the SDK's
        # own CLI; without them it is the embedded localtinker over this project's checkpoint storage.
        resource = TinkerResource(base_url=os.environ.get("TINKER_BASE_URL"), api_key=os.environ.get("TINKER_API_KEY"))
        endpoint = resource.endpoint()
        service = tinker.ServiceClient(base_url=endpoint.base_url, api_key=endpoint.api_key)
        rest = tinker.RestClient(base_url=endpoint.base_url, api_key=endpoint.api_key)
        try:
            base_model = base_model or _base_model_of(rest, path)
            # The packaged models resolve to their local directories, anything else to itself (a directory or hub id).
            source = tokenizer_path(base_model)
            report = export_checkpoint(service, rest, path, Path(out), base_model, source, merged=merged, gguf=gguf, card=card)
        finally:
            service.close("success").result(timeout=60)
    except (ExportError, LookupError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json(), indent=1))
    return 0 if report.within_tolerance else 1
