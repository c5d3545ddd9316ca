"""Exported models for every recipe, from one factory: ``<recipe>_export``, partitioned like ``<recipe>_checkpoints``.

Materializing a checkpoint's partition (from the UI, or ``python -m pipelines export``, which runs the same
``resources.hf_export`` code) downloads it through the Tinker resource as a PEFT adapter, optionally merges it into
a plain Hugging Face model, verifies both against the server's ``compute_logprobs``, and attaches the files to
the checkpoint's MLflow logged model (lineage tags kept) with the figures on its registered model version. The
files live under ``<state>/exports/<partition>``; a re-materialization replaces them whole or not at all.
Not on-missing automation (that would export every checkpoint): exports are requested, from the UI, the CLI,
or the ``export_best_checkpoints`` sensor for each recipe's ``best`` (``pipelines/exports.py``).
"""

import shutil
import time

import dagster as dg
from pydantic import Field

from assets.checkpoint_manifest import read_manifest
from assets.registration import checkpoints_asset_key
from assets.training import TINKER_POOL, TrainingSpec
from posttrain.export.adapter import ExportError
from resources.hf_export.export import export_checkpoint
from resources.mlflow import MlflowResource, metric_name
from resources.models import tokenizer_path
from resources.state import state_subdir
from resources.tinker import TinkerResource

EXPORT_GROUP = "export"


class ExportConfig(dg.Config):
    merged: bool = Field(default=True, description="Also write the merged Hugging Face model (safetensors, config, tokenizer).")
    gguf: bool = Field(default=False, description="Also write a float32 GGUF file of the merged model (llama.cpp, transformers).")


def build_export_asset(training: TrainingSpec) -> dg.AssetsDefinition:
    recipe = training.recipe

    @dg.asset(
        name=f"{recipe}_export",
        group_name=EXPORT_GROUP,
        kinds={"tinker", "mlflow", "huggingface"},
        partitions_def=training.partitions,
        deps=[checkpoints_asset_key(recipe)],
        pool=TINKER_POOL,
        description=f"One {recipe} checkpoint as a PEFT adapter and merged HF model, verified against the server.",
    )
    def _export(context: dg.AssetExecutionContext, config: ExportConfig, tinker: TinkerResource, mlflow: MlflowResource) -> dg.MaterializeResult:
        manifest = read_manifest(context.partition_key)
        if not manifest.state_path:
            raise dg.Failure(f"checkpoint {manifest.partition} saved no training state (state_path); nothing to export")
        target = state_subdir("exports") / manifest.partition
        fresh = target.with_name(f"{target.name}.new-{time.monotonic_ns()}")
        card = {
            "title": f"{manifest.registered_model} v{manifest.model_version}",
            "recipe": recipe,
            "partition": manifest.partition,
            "registered_model": manifest.registered_model,
            "model_version": manifest.model_version,
            "data_versions": {asset: str(info.get("data_version", "")) for asset, info in manifest.upstream.items()},
        }
        endpoint = tinker.endpoint()
        with tinker.session(f"export {manifest.partition}") as client:
            import tinker as tinker_sdk

            rest = tinker_sdk.RestClient(base_url=endpoint.base_url, api_key=endpoint.api_key)
            try:
                report = export_checkpoint(
                    client, rest, manifest.state_path, fresh, manifest.base_model, tokenizer_path(manifest.base_model),
                    merged=config.merged, gguf=config.gguf, card=card,
                )
            except ExportError as error:
                raise dg.Failure(str(error)) from error
        if target.exists():
            shutil.rmtree(target)
        fresh.rename(target)
        mlflow_client = mlflow.get_client()
        if manifest.mlflow_model_id:
            mlflow_client.log_model_artifacts(manifest.mlflow_model_id, str(target))
        figures = {"adapter_max_abs_logprob_diff": report.adapter_max_abs_logprob_diff,
                   "merged_max_abs_logprob_diff": report.merged_max_abs_logprob_diff,
                   "gguf_max_abs_logprob_diff": report.gguf_max_abs_logprob_diff}
        for name, value in figures.items():
            if value is not None:
                mlflow_client.set_model_version_tag(manifest.registered_model, manifest.model_version, metric_name(f"export.{name}"), f"{value:.3g}")
        if not report.within_tolerance:
            context.log.warning(f"export of {manifest.partition} differs from the server beyond the float32 bounds: {figures}")
        return dg.MaterializeResult(
            metadata={
                "path": dg.MetadataValue.path(str(target)),
                "checkpoint": manifest.state_path,
                "base_model": manifest.base_model,
                **{name: value for name, value in figures.items() if value is not None},
                "verified_tokens": report.verified_tokens,
                "within_tolerance": report.within_tolerance,
                "seconds": dg.MetadataValue.json({k: round(v, 2) for k, v in report.seconds.items()}),
                "mlflow_logged_model": manifest.mlflow_model_id or "none",
            }
        )

    return _export
