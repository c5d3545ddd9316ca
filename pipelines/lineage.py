"""Trace a checkpoint back through every hop of its chain, and forward to its eval reports.

For a checkpoint (``tinker://`` path, ``<registered model>/<version>`` or partition key) it prints one
block per hop — the checkpoint, its training run (Dagster + MLflow), the exact data versions it was
trained on, the checkpoints it learned from besides its parent (DPO reference, distillation teachers,
on-policy pair sampler) and its eval reports — then follows ``init_from`` to the parent checkpoint and
repeats (RL ← DPO ← SFT), and ends at the base model. Sources: checkpoint manifests (written by the
training asset's registration), the Dagster instance (runs, eval materializations) and the MLflow
registry (model versions and their tags).

``lineage_json`` is the same trace for machines (``python -m pipelines lineage <ref> --json``): one object
per hop, each listing its datasets as ``{asset, data_version, source, revision, rows, ...}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import dagster as dg
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from assets.checkpoint_manifest import CheckpointManifest, find_manifest
from assets.upstream import plain_value
from resources.mlflow_links import absolute_mlflow_url

DAGSTER_UI_URL = "http://127.0.0.1:3000"
MAX_HOPS = 32  # a chain longer than this is a cycle in hand-edited manifests


@dataclass
class Hop:
    manifest: CheckpointManifest
    training_run_status: str
    training_job: str
    model_version_tags: dict[str, str]
    eval_reports: list[dict[str, Any]] = field(default_factory=list)
    related: dict[str, Hop] = field(default_factory=dict)  # role (teacher:..., reference) -> traced checkpoint


@dataclass
class Lineage:
    hops: list[Hop]  # the checkpoint first, then its parent, grandparent ...

    @property
    def manifest(self) -> CheckpointManifest:
        return self.hops[0].manifest


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
    hops = []
    manifest: CheckpointManifest | None = resolve_reference(reference, mlflow_client)
    while manifest is not None and len(hops) < MAX_HOPS:
        hops.append(_hop(manifest, instance, mlflow_client, follow_related=True))
        manifest = find_manifest(manifest.parent_partition) if manifest.parent_partition else None
    return Lineage(hops)


def _hop(manifest: CheckpointManifest, instance, mlflow_client, follow_related: bool) -> Hop:
    run = instance.get_run_by_id(manifest.training_dagster_run_id)
    try:
        tags = dict(mlflow_client.get_model_version(manifest.registered_model, manifest.model_version).tags)
    except MlflowException:
        tags = {}
    hop = Hop(
        manifest=manifest,
        training_run_status=run.status.value if run else "unknown (not in this DAGSTER_HOME)",
        training_job=run.job_name if run else "?",
        model_version_tags=tags,
        eval_reports=eval_reports(instance, manifest),
    )
    if follow_related:
        for role, partition in related_checkpoints(manifest).items():
            try:
                hop.related[role] = _hop(find_manifest(partition), instance, mlflow_client, follow_related=False)
            except LookupError:
                continue
    return hop


def related_checkpoints(manifest: CheckpointManifest) -> dict[str, str]:
    """Checkpoint partitions named in ``manifest.related`` (teachers, reference, pair sampler), by role."""
    found = {}
    for role, value in manifest.related.items():
        values = value if isinstance(value, list) else [value]
        for index, item in enumerate(values):
            partition = item.get("partition") if isinstance(item, dict) else None
            if partition:
                found[role if len(values) == 1 else f"{role}[{index}]"] = partition
    return found


def eval_reports(instance: dg.DagsterInstance, manifest: CheckpointManifest) -> list[dict[str, Any]]:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(f"{manifest.recipe}_eval_report"), asset_partitions=[manifest.partition]),
        limit=20,
    ).records
    reports = []
    for record in records:
        metadata = {k: plain_value(v) for k, v in record.asset_materialization.metadata.items()}
        reports.append({"run_id": record.run_id, "timestamp": record.timestamp, **metadata})
    return reports


def datasets_of(manifest: CheckpointManifest) -> list[dict[str, Any]]:
    """Every table a checkpoint was trained from (directly or through a token/pair table), as plain objects:
    the exact version read, where its rows came from and at which source revision, and how many rows."""
    found = []
    for asset, version in manifest.upstream.items():
        if asset == "base_model":
            continue
        metadata = version.get("metadata", {})
        found.append({
            "asset": asset,
            "data_version": version.get("data_version"),
            "source": metadata.get("source"),
            "source_kind": metadata.get("source_kind"),
            "revision": metadata.get("revision"),
            "rows": metadata.get("dagster/row_count"),
            "splits": {key.split("/", 1)[1]: value for key, value in metadata.items() if key.startswith("split/")},
            "rows_read": metadata.get("rows_read"),
            "skipped_rows": metadata.get("skipped_rows"),
            "made_by_run": version.get("dagster_run_id"),
        })
    return found


def _hop_json(hop: Hop, dagster_ui_url: str) -> dict[str, Any]:
    m = hop.manifest
    return {
        "partition": m.partition,
        "recipe": m.recipe,
        "step": m.step,
        "final": m.final,
        "state_path": m.state_path,
        "sampler_path": m.sampler_path,
        "model": {"registered_model": m.registered_model, "version": m.model_version, "mlflow_model_id": m.mlflow_model_id},
        "training_run": {
            "dagster_run_id": m.training_dagster_run_id,
            "job": hop.training_job,
            "status": hop.training_run_status,
            "url": f"{dagster_ui_url}/runs/{m.training_dagster_run_id}",
            "mlflow_run_id": m.mlflow_run_id,
            "mlflow_run_url": m.mlflow_run_url,
        },
        "started_from": m.parent_partition or m.init_from,
        "renderer": m.renderer,
        "datasets": datasets_of(m),
        "related": {role: _hop_json(related, dagster_ui_url) for role, related in hop.related.items()},
        "eval_reports": hop.eval_reports,
    }


def lineage_json(lineage: Lineage, dagster_ui_url: str = DAGSTER_UI_URL) -> dict[str, Any]:
    """The trace as one JSON-ready object: ``hops`` from the checkpoint back to the root, then ``base_model``."""
    root = lineage.hops[-1].manifest
    base = root.upstream.get("base_model", {})
    return {
        "checkpoint": lineage.manifest.partition,
        "hops": [_hop_json(hop, dagster_ui_url) for hop in lineage.hops],
        "base_model": {
            "name": root.base_model,
            "weights": base.get("metadata", {}).get("weights_location"),
            "digest": root.base_model_digest,
            "tokenizer": root.tokenizer or None,
            "data_version": base.get("data_version"),
        },
    }


def _data_lines(manifest: CheckpointManifest) -> list[str]:
    lines = []
    for asset, version in manifest.upstream.items():
        if asset == "base_model":
            continue
        metadata = version.get("metadata", {})
        detail = metadata.get("source") or metadata.get("renderer") or ""
        if metadata.get("revision"):
            detail += f" @ {metadata['revision']}"
        lines.append(f"  data          {asset} @ {version.get('data_version', '?')}  made by run {version.get('dagster_run_id', '?')}"
                     + (f"  ({detail})" if detail else ""))
    return lines


def _hop_lines(hop: Hop, dagster_ui_url: str, indent: str = "") -> list[str]:
    m = hop.manifest
    lines = [
        f"checkpoint      {m.partition}  ({m.recipe}, step {m.step}{', final' if m.final else ''})",
        f"  state         {m.state_path}",
        f"  sampler       {m.sampler_path}",
        f"  MLflow model  {m.registered_model} v{m.model_version}",
        f"  training run  Dagster {m.training_dagster_run_id}  job {hop.training_job}, {hop.training_run_status}  {dagster_ui_url}/runs/{m.training_dagster_run_id}",
        f"                MLflow {m.mlflow_run_id}  {absolute_mlflow_url(m.mlflow_run_url)}",
        f"  started from  {m.parent_partition or m.init_from or 'the base model'}",
        *_data_lines(m),
    ]
    for report in hop.eval_reports:
        scores = ", ".join(
            f"{key[len('checkpoint_'):]} {value:.4f}" for key, value in report.items()
            if key.startswith("checkpoint_") and isinstance(value, float)
        )
        lines.append(f"  eval report   run {report['run_id']}: {scores}")
    if not hop.eval_reports:
        lines.append("  eval report   none yet")
    for role, related in hop.related.items():
        lines.append(f"  {role:<13} {related.manifest.partition} ({related.manifest.recipe}, step {related.manifest.step})")
        lines += ["    " + line for line in _data_lines(related.manifest)]
    return [indent + line for line in lines]


def format_lineage(lineage: Lineage, dagster_ui_url: str = DAGSTER_UI_URL) -> str:
    lines = []
    for depth, hop in enumerate(lineage.hops):
        if depth:
            lines.append("  ▲ trained from")
        lines += _hop_lines(hop, dagster_ui_url)
    root = lineage.hops[-1].manifest
    base = root.upstream.get("base_model", {})
    lines += [
        "  ▲ trained from",
        f"base model      {root.base_model}",
        f"  weights       {base.get('metadata', {}).get('weights_location', '?')}",
        f"  digest        {root.base_model_digest}",
        f"  tokenizer     {root.tokenizer or '?'}",
    ]
    return "\n".join(lines)
