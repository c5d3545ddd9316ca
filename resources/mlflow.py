"""MLflow tracking for materializations: one MLflow run per asset materialization.

Our own small resource rather than dagster-mlflow, whose run never ends for asset jobs. Each
materialization opens a run tagged with the Dagster run id, asset key and partition, and closes it
FINISHED or FAILED with the step. Through the run an asset logs params (secret-looking keys are
refused), per-step metrics (:class:`MlflowRun` satisfies posttrain's ``MetricsLogger`` protocol:
``log_metrics(metrics, step)``), its input datasets with their digests (``log_inputs``, what
``mlflow.log_input`` does), and registers checkpoints as model versions whose tags carry lineage.
The run's UI link goes back onto the asset as ``dg.MetadataValue.url``.

We use ``MlflowClient`` with an explicit tracking URI, not the fluent API's process-global active
run, so two stores (tests) or two assets in one process cannot write into each other's runs.
Default store: sqlite at ``<state>/mlflow/mlflow.db`` with artifacts beside it (absolute paths).
"""

from __future__ import annotations

import functools
import json
import re
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import dagster as dg
from mlflow import MlflowClient
from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunStatus
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from pydantic import Field

from resources.state import default_mlflow_artifact_root, default_mlflow_tracking_uri

# Tag names other tools (the lineage command, the MLflow UI filter box) search by.
TAG_DAGSTER_RUN_ID = "dagster.run_id"
TAG_DAGSTER_JOB = "dagster.job"
TAG_ASSET_KEY = "dagster.asset_key"
TAG_PARTITION = "dagster.partition"

SECRET_NAME = re.compile(r"(api[_-]?key|secret|password|credential|access[_-]?token|auth[_-]?token|hf[_-]?token)", re.IGNORECASE)
MAX_PARAM_CHARS = 6000  # MLflow rejects longer param values


@dataclass
class MlflowRun:
    """An open MLflow run; the handle an asset logs through."""

    client: MlflowClient
    run_id: str
    experiment_id: str
    url: str
    ui_url: str

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Logs hyper-parameters; refuses names that look like secrets rather than risk leaking one."""
        secret = [name for name in params if SECRET_NAME.search(name)]
        if secret:
            raise ValueError(
                f"MlflowRun.log_params: {secret} look like secrets and must not be logged as MLflow params; "
                "drop them from the dict (describe the backend with TinkerResource.describe() instead)."
            )
        batch = [Param(name, str(value)[:MAX_PARAM_CHARS]) for name, value in params.items()]
        for start in range(0, len(batch), 100):  # MLflow's per-request limit
            self.client.log_batch(self.run_id, params=batch[start : start + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """posttrain ``MetricsLogger``: one call per training step; non-numeric values are skipped."""
        timestamp = int(time.time() * 1000)
        batch = [
            Metric(_metric_name(name), float(value), timestamp, step)
            for name, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        ]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        """Part of posttrain's ``MetricsLogger``; the run itself ends with :meth:`MlflowResource.start_run`."""

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        for name, value in tags.items():
            self.client.set_tag(self.run_id, name, str(value))

    def log_dataset(
        self,
        name: str,
        source: str,
        digest: str,
        context: str = "training",
        profile: Mapping[str, Any] | None = None,
    ) -> None:
        """Records an input dataset (name, where it lives, content digest) on the run's Datasets tab."""
        dataset = MetaDataset(_dataset_source(source), name=name, digest=digest[:36])
        entity = dataset._to_mlflow_entity()
        if profile:
            entity._profile = json.dumps(dict(profile))
        tags = [InputTag("mlflow.data.context", context), InputTag("dagster.data_version", digest)]
        self.client.log_inputs(self.run_id, datasets=[DatasetInput(entity, tags)])

    def log_dict(self, payload: Mapping[str, Any] | list[Any], artifact_file: str) -> None:
        self.client.log_dict(self.run_id, payload, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def register_checkpoint(self, model_name: str, tinker_path: str, tags: Mapping[str, Any]) -> ModelVersion:
        """The version of ``model_name`` whose source is the ``tinker://`` path (created once: idempotent)."""
        existing = self.client.search_model_versions(f"name = '{model_name}' and tags.tinker_path = '{tinker_path}'")
        if existing:
            return existing[0]
        try:
            self.client.create_registered_model(model_name)
        except MlflowException as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        return self.client.create_model_version(
            model_name,
            source=tinker_path,
            run_id=self.run_id,
            tags={name: str(value) for name, value in tags.items()},
            description=f"Tinker checkpoint {tinker_path}",
        )

    def model_version_url(self, version: ModelVersion) -> str:
        return f"{self.ui_url}/#/models/{version.name}/versions/{version.version}"


class MlflowResource(dg.ConfigurableResource):
    """Opens one MLflow run per materialization (see module docstring)."""

    tracking_uri: str | None = Field(
        default=None, description="MLflow tracking URI. Empty: sqlite at <state dir>/mlflow/mlflow.db."
    )
    artifact_root: str | None = Field(
        default=None, description="Artifact location for new experiments. Empty: <state dir>/mlflow/artifacts."
    )
    experiment_name: str = Field(default="posttrain", description="MLflow experiment that runs are created in.")
    ui_url: str = Field(
        default="http://127.0.0.1:5000", description="Where the MLflow UI is served (`make ui`); used for links."
    )

    def resolved_tracking_uri(self) -> str:
        return self.tracking_uri or default_mlflow_tracking_uri()

    def get_client(self) -> MlflowClient:
        return _client_for(self.resolved_tracking_uri())

    def experiment_id(self, client: MlflowClient) -> str:
        experiment = client.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            return experiment.experiment_id
        artifact_root = self.artifact_root or default_mlflow_artifact_root().as_uri()
        try:
            return client.create_experiment(self.experiment_name, artifact_location=artifact_root)
        except MlflowException:  # another process created it between our two calls
            return client.get_experiment_by_name(self.experiment_name).experiment_id

    def run_url(self, experiment_id: str, run_id: str) -> str:
        return f"{self.ui_url}/#/experiments/{experiment_id}/runs/{run_id}"

    @contextmanager
    def start_run(
        self,
        context: dg.AssetExecutionContext | dg.OpExecutionContext,
        run_name: str | None = None,
        tags: Mapping[str, Any] | None = None,
        resume_tag: tuple[str, str] | None = None,
    ) -> Iterator[MlflowRun]:
        """An MLflow run for this materialization, FINISHED on success and FAILED on any exception.

        ``resume_tag=(name, value)``: when an unfinished run (killed or failed) of this experiment carries
        that tag, continue it instead of opening a new one, so a resumed training run keeps one metric
        history (the trainer logs each step exactly once across the kill). The run then also records
        the re-executing Dagster run id under ``dagster.run_id``.
        """
        client = self.get_client()
        experiment_id = self.experiment_id(client)
        run_tags = {
            TAG_DAGSTER_RUN_ID: context.run.run_id,
            TAG_DAGSTER_JOB: context.run.job_name,
            **_asset_tags(context),
            **{name: str(value) for name, value in (tags or {}).items()},
        }
        previous = self._unfinished_run(client, experiment_id, resume_tag) if resume_tag else None
        if previous is not None:
            client.update_run(previous.info.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            for name, value in run_tags.items():
                client.set_tag(previous.info.run_id, name, value)
            run = previous
        else:
            run = client.create_run(experiment_id, run_name=run_name, tags=run_tags)
        handle = MlflowRun(
            client=client,
            run_id=run.info.run_id,
            experiment_id=experiment_id,
            url=self.run_url(experiment_id, run.info.run_id),
            ui_url=self.ui_url,
        )
        context.log.info(f"MLflow run {handle.run_id}{' (resumed)' if previous else ''}: {handle.url}")
        try:
            yield handle
        except BaseException:
            client.set_terminated(handle.run_id, status=RunStatus.to_string(RunStatus.FAILED))
            raise
        client.set_terminated(handle.run_id, status=RunStatus.to_string(RunStatus.FINISHED))


    @staticmethod
    def _unfinished_run(client: MlflowClient, experiment_id: str, tag: tuple[str, str]):
        name, value = tag
        runs = client.search_runs(
            [experiment_id],
            f"tags.`{name}` = '{value}' and attributes.status != 'FINISHED'",
            max_results=1,
            order_by=["attributes.start_time DESC"],
        )
        return runs[0] if runs else None


@functools.lru_cache(maxsize=8)
def _client_for(uri: str) -> MlflowClient:
    """One client per store and process: opening a sqlite store runs its schema check (~1.5 s)."""
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _asset_tags(context: dg.AssetExecutionContext | dg.OpExecutionContext) -> dict[str, str]:
    tags: dict[str, str] = {}
    if isinstance(context, dg.AssetExecutionContext) or getattr(context, "has_assets_def", False):
        tags[TAG_ASSET_KEY] = context.asset_key.to_user_string()
    if context.has_partition_key:
        tags[TAG_PARTITION] = context.partition_key
    return tags


def _metric_name(name: str) -> str:
    """MLflow allows ``[\\w./ -]``; posttrain metrics use ``loss:sum`` style names."""
    return re.sub(r"[^\w./ -]", "_", name)


def _dataset_source(source: str):
    """Resolves a path or URI to an MLflow dataset source; unknown schemes become a plain URI source."""
    try:
        with warnings.catch_warnings():  # "can be interpreted in multiple ways" for every local path
            warnings.simplefilter("ignore", UserWarning)
            return resolve_dataset_source(source)
    except MlflowException:
        from mlflow.data.http_dataset_source import HTTPDatasetSource

        return HTTPDatasetSource(source)
