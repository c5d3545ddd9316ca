"""Trace a checkpoint back to everything it came from, and forward to its eval reports.

checkpoint → training run (Dagster + MLflow) → rendered tokens (data version) → dataset (source,
digest) → base model (weights, digest), then every eval report of the checkpoint. Sources: the
checkpoint manifest (written by the training asset), the Dagster instance's event log (exact upstream
materializations), and the MLflow registry (the model version and its tags).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import dagster as dg
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from assets.checkpoint_manifest import CheckpointManifest, find_manifest
from assets.upstream import plain_value

DAGSTER_UI_URL = "http://127.0.0.1:3000"


@dataclass
class Lineage:
    manifest: CheckpointManifest
    training_run_status: str
    training_job: str
    model_version_tags: dict[str, str]
    eval_reports: list[dict[str, Any]] = field(default_factory=list)


def resolve_reference(reference: str, mlflow_client: MlflowClient) -> CheckpointManifest:
    """A tinker path, ``<registered model>/<version>`` or partition key → the checkpoint's manifest."""
    try:
        return find_manifest(reference)
    except LookupError:
        pass
    name, _, version = reference.rpartition("/")
    if name and version.isdigit() and not reference.startswith("tinker://"):
        try:
            partition = mlflow_client.get_model_version(name, version).tags.get("dagster.partition")
        except MlflowException as error:
            raise LookupError(f"MLflow has no model version {reference!r}: {error.message}") from error
        if partition:
            return find_manifest(partition)
    return find_manifest(reference)  # raises the LookupError that says what to pass


def trace(reference: str, instance: dg.DagsterInstance, mlflow_client: MlflowClient) -> Lineage:
    manifest = resolve_reference(reference, mlflow_client)
    run = instance.get_run_by_id(manifest.training_dagster_run_id)
    try:
        tags = dict(mlflow_client.get_model_version(manifest.registered_model, manifest.model_version).tags)
    except MlflowException:
        tags = {}
    return Lineage(
        manifest=manifest,
        training_run_status=run.status.value if run else "unknown (not in this DAGSTER_HOME)",
        training_job=run.job_name if run else "?",
        model_version_tags=tags,
        eval_reports=eval_reports(instance, manifest.partition),
    )


def eval_reports(instance: dg.DagsterInstance, partition: str) -> list[dict[str, Any]]:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("eval_report"), asset_partitions=[partition]), limit=20
    ).records
    reports = []
    for record in records:
        metadata = {k: plain_value(v) for k, v in record.asset_materialization.metadata.items()}
        reports.append({"run_id": record.run_id, "timestamp": record.timestamp, **metadata})
    return reports


def format_lineage(lineage: Lineage, dagster_ui_url: str = DAGSTER_UI_URL) -> str:
    m = lineage.manifest
    upstream = m.upstream
    tokens = upstream.get("rendered_tokens", {})
    dataset_key = next((key for key in upstream if key not in ("rendered_tokens", "base_model")), None)
    dataset = upstream.get(dataset_key, {}) if dataset_key else {}
    base = upstream.get("base_model", {})
    lines = [
        f"checkpoint      {m.partition}  (step {m.step}{', final' if m.final else ''})",
        f"  state         {m.state_path}",
        f"  sampler       {m.sampler_path}",
        f"  MLflow model  {m.registered_model} v{m.model_version}",
        f"  version tags  {', '.join(f'{k}={v}' for k, v in sorted(lineage.model_version_tags.items()) if not k.startswith('eval.')) or '-'}",
        "training run",
        f"  Dagster       {m.training_dagster_run_id}  job {lineage.training_job}, {lineage.training_run_status}  {dagster_ui_url}/runs/{m.training_dagster_run_id}",
        f"  MLflow        {m.mlflow_run_id}  {m.mlflow_run_url}",
        f"  log dir       {m.log_dir}",
        "rendered tokens (rendered_tokens)",
        f"  data version  {tokens.get('data_version', '?')}  made by run {tokens.get('dagster_run_id', '?')}",
        f"  renderer      {m.renderer or '?'}  rows {tokens.get('metadata', {}).get('dagster/row_count', '?')}",
        f"dataset ({dataset_key or '?'})",
        f"  source        {dataset.get('metadata', {}).get('source', '?')}",
        f"  digest        {dataset.get('metadata', {}).get('data_digest', dataset.get('data_version', '?'))}  made by run {dataset.get('dagster_run_id', '?')}",
        f"base model      {m.base_model}",
        f"  weights       {base.get('metadata', {}).get('weights_location', '?')}",
        f"  digest        {m.base_model_digest}",
        f"eval reports    {len(lineage.eval_reports) or 'none yet'}",
    ]
    for report in lineage.eval_reports:
        scores = ", ".join(
            f"{name} {report.get(f'checkpoint_{name}', float('nan')):.4f} (base {report.get(f'base_{name}', float('nan')):.4f})"
            for name in ("nll", "bpb", "accuracy")
        )
        lines.append(f"  run {report['run_id']}: {scores}  {report.get('mlflow_run', '')}")
    return "\n".join(lines)
