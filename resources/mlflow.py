"""MLflow tracking for materializations: one MLflow run per asset materialization.

Our own small resource rather than dagster-mlflow, whose run never ends for asset jobs. Each
materialization opens a run tagged with the Dagster run id, asset key and partition, and closes it
FINISHED or FAILED with the step. Through the run an asset logs params and tags (secret-looking names
are refused), per-step metrics (:class:`MlflowRun` satisfies posttrain's ``MetricsLogger`` protocol:
``log_metrics(metrics, step)``), its input datasets with their digests (``log_dataset``), and registers
checkpoints (``register_checkpoint``): each one an MLflow 3 logged model plus a version of the recipe's
registered model. Evaluations keep the ``latest-evaluated`` and ``best`` aliases of that registered model up to date
(``MlflowResource.update_aliases``); ``init_from="best:<recipe>"`` reads them back (``resolve_alias``).
The run's UI link goes back onto the asset as ``dg.MetadataValue.url``.

We use ``MlflowClient`` with an explicit tracking URI, not the fluent API's process-global active
run, so two stores (tests) or two assets in one process cannot write into each other's runs. For the
same reason a model version's source is the checkpoint's ``tinker://`` path, not ``models:/<model_id>``
(MLflow's sqlite registry resolves such a source through the process-global tracking URI).
Only public MLflow APIs are used. Default store: sqlite at ``<state>/mlflow/mlflow.db`` with artifacts
beside it (absolute paths).
"""

from __future__ import annotations

import functools
import json
import math
import re
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg
from mlflow import MlflowClient
from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import (
    Dataset,
    DatasetInput,
    InputTag,
    LoggedModel,
    LoggedModelOutput,
    LoggedModelStatus,
    Metric,
    Param,
    RunStatus,
)
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.models.utils import get_external_mlflow_model_spec
from mlflow.utils.mlflow_tags import MLFLOW_MODEL_IS_EXTERNAL, MLFLOW_MODEL_VERSIONS
from pydantic import Field

from resources.mlflow_links import DEFAULT_MLFLOW_UI_URL, MLFLOW_LINK_PREFIX, absolute_mlflow_url, mlflow_link
from resources.state import default_mlflow_artifact_root, default_mlflow_tracking_uri

# Tag names other tools (the lineage command, the MLflow UI filter box) search by.
TAG_DAGSTER_RUN_ID = "dagster.run_id"
TAG_DAGSTER_JOB = "dagster.job"
TAG_ASSET_KEY = "dagster.asset_key"
TAG_PARTITION = "dagster.partition"
TAG_TINKER_PATH = "tinker_path"  # on logged models and model versions: the idempotency key of a checkpoint
TAG_STEP = "step"
TAG_LOGGED_MODEL_ID = "logged_model_id"  # on model versions (the sqlite registry does not store model_id)
TAG_EVALUATED = "eval.evaluated"  # on model versions: an evaluation finished (candidates for latest-evaluated)
TAG_EVAL_SCORE = "eval.score"  # on model versions: the held-out task score (candidates for `best`)
BENCHMARK_TAG_PREFIX = "benchmark."  # on model versions: benchmark.<name> = score (+ .stderr, .n), see record_benchmark

ALIAS_LATEST = "latest-evaluated"  # MLflow reserves "latest" (models:/<name>/latest = newest version, evaluated or not)
ALIAS_BEST = "best"
ALIAS_ATTEMPTS = 8  # rounds of read-compare-write in update_aliases before concurrent writers are reported
CHECKPOINT_MODEL_TYPE = "tinker-lora"

SECRET_NAME = re.compile(r"(api[_-]?key|secret|password|credential|access[_-]?token|auth[_-]?token|hf[_-]?token)", re.IGNORECASE)
MAX_PARAM_CHARS = 6000  # MLflow rejects longer param values
MAX_DATASET_DIGEST_CHARS = 36  # MLflow's column width for dataset digests
TINKER_PATH = re.compile(r"^tinker://[^\s']+$")
QUOTE_SAFE_NAME = re.compile(r"^[^'\\]+$")  # names we embed in MLflow filter strings


@dataclass(frozen=True)
class RegisteredCheckpoint:
    """A checkpoint as MLflow knows it: a logged model and the registered-model version pointing at it."""

    model_name: str
    version: int
    model_id: str
    model_version_url: str
    logged_model_url: str

    @property
    def name(self) -> str:
        """``ModelVersion.name``'s spelling, for callers written against the ModelVersion this used to return."""
        return self.model_name


@dataclass
class MlflowRun:
    """An open MLflow run; the handle an asset logs through."""

    client: MlflowClient
    run_id: str
    experiment_id: str
    url: str  # the asset-page link (resources/mlflow_links.py)
    link_base: str  # what model and version links start with: MLFLOW_LINK_PREFIX in production
    # (metric, step) points a killed attempt already logged for steps the resumed run redoes (see truncate_from).
    already_logged: set[tuple[str, int]] = field(default_factory=set)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Logs hyper-parameters; refuses names that look like secrets rather than risk leaking one."""
        refuse_secret_names(params, "MlflowRun.log_params")
        batch = [Param(name, str(value)[:MAX_PARAM_CHARS]) for name, value in params.items()]
        for start in range(0, len(batch), 100):  # MLflow's per-request limit
            self.client.log_batch(self.run_id, params=batch[start : start + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """posttrain ``MetricsLogger``: one call per training step; non-numeric values are skipped."""
        timestamp = int(time.time() * 1000)
        batch = [
            Metric(name, value, timestamp, step)
            for name, value in _numeric_metrics(metrics).items()
            if (metric_name(name), step) not in self.already_logged
        ]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def truncate_from(self, step: int) -> None:
        """Called by the training core when it resumes at ``step``: each metric keeps one point per step.

        MLflow cannot delete metric points, and a kill between committing metrics and recording the
        checkpoint that covers them leaves points of steps the resumed run redoes. Resume is exact, so
        the redone steps reproduce those values: the points already there are kept and the redone
        steps' points for the same (metric, step) are not logged again.
        """
        run = self.client.get_run(self.run_id)
        self.already_logged = {
            (name, point.step)
            for name in run.data.metrics
            for point in self.client.get_metric_history(self.run_id, name)
            if point.step >= step
        }

    def close(self) -> None:
        """Part of posttrain's ``MetricsLogger``; the run itself ends with :meth:`MlflowResource.start_run`."""

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        refuse_secret_names(tags, "MlflowRun.set_tags")
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
        """Records an input dataset (name, where it lives, content digest) on the run's Datasets tab.

        The full digest (a Dagster data version) is kept as the input tag ``dagster.data_version``;
        MLflow's own digest column holds its first 36 characters.
        """
        short_digest = digest[:MAX_DATASET_DIGEST_CHARS]
        described = MetaDataset(_dataset_source(source), name=name, digest=short_digest).to_dict()
        entity = Dataset(
            name=name,
            digest=short_digest,
            source_type=described["source_type"],
            source=described["source"],
            profile=json.dumps(dict(profile)) if profile else None,
        )
        tags = [InputTag("mlflow.data.context", context), InputTag("dagster.data_version", digest)]
        self.client.log_inputs(self.run_id, datasets=[DatasetInput(entity, tags)])

    def log_dict(self, payload: Mapping[str, Any] | list[Any], artifact_file: str) -> None:
        self.client.log_dict(self.run_id, payload, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def register_checkpoint(
        self,
        model_name: str,
        tinker_path: str,
        tags: Mapping[str, Any],
        *,
        step: int | None = None,
        metrics: Mapping[str, Any] | None = None,
        metrics_dataset: str | None = None,
        metrics_step: int | None = None,
    ) -> RegisteredCheckpoint:
        """Registers the checkpoint at ``tinker_path`` as an MLflow 3 logged model and a version of ``model_name``.

        The logged model (type ``tinker-lora``, external: its weights live in Tinker) carries the lineage
        ``tags``, this run's params, ``tinker_path`` and ``step``; it is this run's output at ``step``. The
        step's ``metrics`` are logged with its model id so they show on the model page (pass the values the
        run logged for that step: they are logged with the run's own timestamp so the run's history gets no
        duplicate points). ``metrics_dataset`` names the dataset (given to :meth:`log_dataset` on this run)
        the metrics were measured on; MLflow links a logged model to datasets only through its metrics, one
        dataset per metric point. The version's source is ``tinker_path``; its tags are the lineage ``tags``
        plus ``tinker_path``, ``step`` and ``logged_model_id``.

        ``metrics_step`` (default ``step``) is the run-history step the metrics were logged at: a
        checkpoint taken after ``n`` optimizer steps carries the metrics of step index ``n - 1``.

        Idempotent: every write is found again by ``tinker_path`` first, so calling it again after a kill
        (at any point) completes the registration and returns the same logged model and version.
        """
        lineage = self._checkpoint_tags(model_name, tinker_path, tags, step)
        if metrics and step is None:
            raise ValueError(
                f"MlflowRun.register_checkpoint({model_name!r}, {tinker_path!r}): metrics need the step they were "
                "measured at; pass step=."
            )
        dataset = (metrics_dataset, self._dataset_digest(metrics_dataset)) if metrics_dataset else None
        model = self._logged_model(model_name, tinker_path, step, lineage)
        if metrics and step is not None:
            self._log_model_metrics(model, step if metrics_step is None else metrics_step, _numeric_metrics(metrics), dataset)
        if step is not None:
            self._record_run_output(model.model_id, step)
        version = self._model_version(model_name, tinker_path, model.model_id, lineage)
        self._record_version_on_model(model.model_id, model_name, version)
        return RegisteredCheckpoint(
            model_name=model_name,
            version=version,
            model_id=model.model_id,
            model_version_url=f"{self.link_base.rstrip('/')}/#/models/{model_name}/versions/{version}",
            logged_model_url=f"{self.link_base.rstrip('/')}/#/experiments/{model.experiment_id}/models/{model.model_id}",
        )

    def model_version_url(self, version: ModelVersion | RegisteredCheckpoint) -> str:
        return f"{self.link_base.rstrip('/')}/#/models/{version.name}/versions/{version.version}"

    @staticmethod
    def _checkpoint_tags(model_name: str, tinker_path: str, tags: Mapping[str, Any], step: int | None) -> dict[str, str]:
        where = f"MlflowRun.register_checkpoint({model_name!r}, {tinker_path!r})"
        if not TINKER_PATH.match(tinker_path):
            raise ValueError(
                f"{where}: the checkpoint path must be a tinker:// path (the training state's "
                "`tinker://<run>/weights/<name>`); pass the checkpoint record's state_path."
            )
        if not QUOTE_SAFE_NAME.match(model_name):
            raise ValueError(f"{where}: registered model names may not contain quotes or backslashes; rename the model.")
        refuse_secret_names(tags, where)
        lineage = {name: str(value) for name, value in tags.items()}
        lineage[TAG_TINKER_PATH] = tinker_path
        if step is not None:
            lineage[TAG_STEP] = str(step)
        return lineage

    def _logged_model(self, model_name: str, tinker_path: str, step: int | None, lineage: Mapping[str, str]) -> LoggedModel:
        """The READY logged model of ``tinker_path`` in this experiment, created on first call."""
        found = self.client.search_logged_models(
            [self.experiment_id], filter_string=f"tags.{TAG_TINKER_PATH} = '{tinker_path}'", max_results=1
        )
        if found:
            model = found[0]
        else:
            run_params = self.client.get_run(self.run_id).data.params
            checkpoint_name = tinker_path.rstrip("/").rsplit("/", 1)[-1]
            model = self.client.create_logged_model(
                self.experiment_id,
                name=re.sub(r"[/:.%\"']", "-", f"{model_name}-{checkpoint_name}"),
                source_run_id=self.run_id,
                tags={**lineage, MLFLOW_MODEL_IS_EXTERNAL: "true"},
                params={**run_params, TAG_TINKER_PATH: tinker_path, **({TAG_STEP: str(step)} if step is not None else {})},
                model_type=CHECKPOINT_MODEL_TYPE,
            )
        if model.status != LoggedModelStatus.READY:
            self._write_external_model_spec(model)
            model = self.client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        return model

    def _write_external_model_spec(self, model: LoggedModel) -> None:
        """The MLmodel file MLflow writes for external models, so ``models:/<model_id>`` loads its metadata."""
        with tempfile.TemporaryDirectory() as directory:
            get_external_mlflow_model_spec(model).save(str(Path(directory) / "MLmodel"))
            self.client.log_model_artifacts(model.model_id, directory)

    def _log_model_metrics(
        self, model: LoggedModel, step: int, values: Mapping[str, float], dataset: tuple[str, str] | None
    ) -> None:
        """Metrics with the model id (and the dataset) land on the model page and in the run's history."""
        timestamp = self._step_timestamp(step, values) or model.creation_timestamp
        dataset_name, dataset_digest = dataset or (None, None)
        batch = [
            Metric(name, value, timestamp, step, model_id=model.model_id, dataset_name=dataset_name, dataset_digest=dataset_digest)
            for name, value in values.items()
        ]
        for start in range(0, len(batch), 1000):  # MLflow's per-request metric limit
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def _step_timestamp(self, step: int, values: Mapping[str, float]) -> int | None:
        """When this run logged ``step`` (log_metrics gives a step's metrics one timestamp), if it did."""
        first_name = next(iter(values), None)
        if first_name is None:
            return None
        history = self.client.get_metric_history(self.run_id, first_name)
        return next((point.timestamp for point in history if point.step == step), None)

    def _dataset_digest(self, name: str) -> str:
        digests = {i.dataset.name: i.dataset.digest for i in self.client.get_run(self.run_id).inputs.dataset_inputs}
        if name not in digests:
            raise ValueError(
                f"MlflowRun.register_checkpoint: metrics_dataset={name!r} was not logged on run {self.run_id} "
                f"(logged: {sorted(digests)}); call log_dataset for it first."
            )
        return digests[name]

    def _record_run_output(self, model_id: str, step: int) -> None:
        outputs = self.client.get_run(self.run_id).outputs
        if not any(output.model_id == model_id for output in (outputs.model_outputs if outputs else [])):
            self.client.log_outputs(self.run_id, [LoggedModelOutput(model_id, step)])

    def _model_version(self, model_name: str, tinker_path: str, model_id: str, lineage: Mapping[str, str]) -> int:
        existing = self.client.search_model_versions(f"name = '{model_name}' and tags.{TAG_TINKER_PATH} = '{tinker_path}'")
        if existing:
            return int(existing[0].version)
        try:
            self.client.create_registered_model(model_name)
        except MlflowException as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        created = self.client.create_model_version(
            model_name,
            source=tinker_path,
            run_id=self.run_id,
            tags={**lineage, TAG_LOGGED_MODEL_ID: model_id},
            description=f"Tinker checkpoint {tinker_path}",
            model_id=model_id,
        )
        return int(created.version)

    def _record_version_on_model(self, model_id: str, model_name: str, version: int) -> None:
        """The ``mlflow.modelVersions`` tag is how the MLflow UI lists a logged model's registered versions."""
        recorded = json.loads(self.client.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS) or "[]")
        entry = {"name": model_name, "version": version}
        if entry not in recorded:
            self.client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps([*recorded, entry])})


class MlflowResource(dg.ConfigurableResource):
    """Opens one MLflow run per materialization and keeps registered-model aliases (see module docstring)."""

    tracking_uri: str | None = Field(
        default=None, description="MLflow tracking URI. Empty: sqlite at <state dir>/mlflow/mlflow.db."
    )
    artifact_root: str | None = Field(
        default=None, description="Artifact location for new experiments. Empty: <state dir>/mlflow/artifacts."
    )
    experiment_name: str = Field(default="posttrain", description="MLflow experiment that runs are created in.")
    ui_url: str = Field(
        default=DEFAULT_MLFLOW_UI_URL,
        description="Where the MLflow UI is served (`make ui` sets $MLFLOW_UI_URL); used for links printed in logs. "
        "Asset pages link through the Dagster UI's /mlflow redirect instead, which follows the UI wherever it runs.",
    )
    best_follows: str | None = Field(
        default=None,
        description="Empty: the alias `best` follows each recipe's held-out eval score. A benchmark name (e.g. gsm8k): "
        "`best` follows that benchmark's score instead (versions not benchmarked yet are not candidates).",
    )

    def score_tag(self) -> str:
        """The model-version tag `best` is chosen by."""
        return benchmark_tag(self.best_follows) if self.best_follows else TAG_EVAL_SCORE

    def record_benchmark(self, model_name: str, version: int | str, benchmark: str, value: float, stderr: float, n: int) -> dict[str, int]:
        """Tags ``version`` with its ``benchmark`` score (``benchmark.<name>``, ``.stderr``, ``.n``); when `best`
        follows this benchmark, marks the version evaluated and moves the aliases as :meth:`update_aliases` does."""
        client = self.get_client()
        tag = benchmark_tag(benchmark)
        for name, text in ((tag, repr(float(value))), (f"{tag}.stderr", repr(float(stderr))), (f"{tag}.n", str(int(n)))):
            client.set_model_version_tag(model_name, str(version), name, text)
        if self.best_follows != benchmark:
            return {}
        client.set_model_version_tag(model_name, str(version), TAG_EVALUATED, "true")
        return self._converge_aliases(client, model_name, version, higher_is_better=True)

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
        """The asset-page link to a run (relative to the Dagster UI; resources/mlflow_links.py)."""
        return mlflow_link(f"#/experiments/{experiment_id}/runs/{run_id}")

    @contextmanager
    def start_run(
        self,
        context: dg.AssetExecutionContext | dg.OpExecutionContext,
        run_name: str | None = None,
        tags: Mapping[str, Any] | None = None,
        resume_tag: tuple[str, str] | None = None,
    ) -> Iterator[MlflowRun]:
        """An MLflow run for this materialization, FINISHED on success and FAILED on any exception.

        ``resume_tag=(name, value)``: when a run of this experiment carries that tag, continue the newest
        such run instead of opening a new one, so a resumed training run keeps one metric history (the
        trainer logs each step exactly once across the kill). Whatever its status: a kill can land after the
        run was marked FINISHED but before Dagster recorded the step's success, and the re-execution is
        still the same training run. The run then also records the re-executing Dagster run id under
        ``dagster.run_id``.
        """
        refuse_secret_names(tags or {}, "MlflowResource.start_run(tags=)")
        client = self.get_client()
        experiment_id = self.experiment_id(client)
        run_tags = {
            TAG_DAGSTER_RUN_ID: context.run.run_id,
            TAG_DAGSTER_JOB: context.run.job_name,
            **_asset_tags(context),
            **{name: str(value) for name, value in (tags or {}).items()},
        }
        previous = self._tagged_run(client, experiment_id, resume_tag) if resume_tag else None
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
            link_base=MLFLOW_LINK_PREFIX,
        )
        context.log.info(f"MLflow run {handle.run_id}{' (resumed)' if previous else ''}: {absolute_mlflow_url(handle.url, self.ui_url)}")
        try:
            yield handle
        except BaseException:
            client.set_terminated(handle.run_id, status=RunStatus.to_string(RunStatus.FAILED))
            raise
        client.set_terminated(handle.run_id, status=RunStatus.to_string(RunStatus.FINISHED))

    def update_aliases(
        self, model_name: str, version: int | str, score: float | None, higher_is_better: bool = True
    ) -> dict[str, int]:
        """Records that ``version`` was evaluated (with its held-out ``score``) and moves the aliases.

        ``latest-evaluated``: the highest evaluated version number (versions are numbered in registration
        order; MLflow reserves the name ``latest`` for the newest version, evaluated or not).
        ``best``: the evaluated version with the best ``eval.score`` (ties: the newer version). Scores are
        version tags, so versions evaluated by other processes take part in the comparison. A version
        evaluated without a score (None) can become ``latest-evaluated`` but never ``best``. Returns alias → version.

        Evaluations of one model run concurrently (the automation sensor launches one per checkpoint), so this
        converges instead of writing once: it re-reads the tags and the aliases until they agree, and a write
        that lost a race (two first-time inserts of one alias: a unique-key violation in a SQL store) only
        sends it round again. Every caller's last read is taken after its own tags and writes, so whichever
        caller finishes last leaves the aliases that every recorded score implies.
        """
        if score is not None and math.isnan(score):
            raise ValueError(
                f"MlflowResource.update_aliases({model_name!r}, {version}): score is NaN; pass None when the "
                "evaluation produced no task score."
            )
        client = self.get_client()
        client.set_model_version_tag(model_name, str(version), TAG_EVALUATED, "true")
        if score is not None:
            client.set_model_version_tag(model_name, str(version), TAG_EVAL_SCORE, repr(float(score)))
        return self._converge_aliases(client, model_name, version, higher_is_better)

    def _converge_aliases(self, client: MlflowClient, model_name: str, version: int | str, higher_is_better: bool) -> dict[str, int]:
        conflict: MlflowException | None = None
        for attempt in range(ALIAS_ATTEMPTS):
            wanted = _wanted_aliases(client, model_name, higher_is_better, self.score_tag())
            current = client.get_registered_model(model_name).aliases
            stale = {alias: target for alias, target in wanted.items() if str(current.get(alias)) != str(target)}
            if not stale:
                return wanted
            try:
                for alias, target in stale.items():
                    client.set_registered_model_alias(model_name, alias, str(target))
            except MlflowException as error:
                if not _is_write_conflict(error):
                    raise
                conflict = error
                time.sleep(0.05 * (attempt + 1))
        raise RuntimeError(
            f"MlflowResource.update_aliases({model_name!r}, {version}): the aliases did not settle after "
            f"{ALIAS_ATTEMPTS} rounds of concurrent writes (last conflict: {conflict}); re-run the evaluation."
        )

    def resolve_alias(self, model_name: str, alias: str) -> ModelVersion:
        """The version behind ``model_name@alias``; LookupError naming the model's aliases when it has none such."""
        client = self.get_client()
        try:
            aliases = client.get_registered_model(model_name).aliases
        except MlflowException as error:
            if error.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            raise LookupError(
                f"MLflow has no registered model {model_name!r} (store {self.resolved_tracking_uri()}); "
                "train that recipe first, or check the name."
            ) from error
        if alias not in aliases:
            existing = ", ".join(f"{name} → v{target}" for name, target in sorted(aliases.items())) or "none"
            raise LookupError(
                f"registered model {model_name!r} has no alias {alias!r} (existing aliases: {existing}); "
                "aliases are set when an eval report of one of its versions finishes: evaluate a checkpoint first."
            )
        return client.get_model_version_by_alias(model_name, alias)

    def alias_partition(self, model_name: str, alias: str) -> str:
        """The checkpoint partition key of ``model_name@alias`` (its ``dagster.partition`` version tag)."""
        version = self.resolve_alias(model_name, alias)
        partition = version.tags.get(TAG_PARTITION)
        if not partition:
            raise LookupError(
                f"{model_name}@{alias} is version {version.version}, which has no {TAG_PARTITION!r} tag: it was not "
                "registered by a training asset; name its tinker:// path instead."
            )
        return partition

    @staticmethod
    def _tagged_run(client: MlflowClient, experiment_id: str, tag: tuple[str, str]):
        name, value = tag
        runs = client.search_runs(
            [experiment_id],
            f"tags.`{name}` = '{value}'",
            max_results=1,
            order_by=["attributes.start_time DESC"],
        )
        return runs[0] if runs else None


def benchmark_tag(benchmark: str) -> str:
    return f"{BENCHMARK_TAG_PREFIX}{benchmark}"


def _wanted_aliases(client: MlflowClient, model_name: str, higher_is_better: bool, score_tag: str = TAG_EVAL_SCORE) -> dict[str, int]:
    """The aliases the evaluated versions' tags imply now (see ``MlflowResource.update_aliases``)."""
    evaluated = client.search_model_versions(f"name = '{model_name}' and tags.`{TAG_EVALUATED}` = 'true'")
    wanted = {ALIAS_LATEST: max(int(v.version) for v in evaluated)}
    scored = [v for v in evaluated if score_tag in v.tags]
    if scored:
        sign = 1.0 if higher_is_better else -1.0
        best = max(scored, key=lambda v: (sign * float(v.tags[score_tag]), int(v.version)))
        wanted[ALIAS_BEST] = int(best.version)
    return wanted


def _is_write_conflict(error: MlflowException) -> bool:
    """A write that lost a race to a concurrent one: a SQL store's integrity or lock error, or its text over REST."""
    cause = error.__cause__
    if cause is not None and type(cause).__name__ in {"IntegrityError", "OperationalError"}:
        return True
    text = str(error.message).lower()
    return any(sign in text for sign in ("unique constraint", "duplicate key", "duplicate entry", "database is locked"))


def refuse_secret_names(values: Mapping[str, Any], where: str) -> None:
    """Params and tags are readable by anyone with the MLflow UI: a secret-looking name is an error, not a risk."""
    secret = [name for name in values if SECRET_NAME.search(name)]
    if secret:
        raise ValueError(
            f"{where}: {secret} look like secrets and must not be logged to MLflow; "
            "drop them from the dict (describe the backend with TinkerResource.describe() instead)."
        )


@functools.lru_cache(maxsize=8)
def _client_for(uri: str) -> MlflowClient:
    """One client per store and process: opening a sqlite store runs its schema check (a second or more)."""
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _asset_tags(context: dg.AssetExecutionContext | dg.OpExecutionContext) -> dict[str, str]:
    tags: dict[str, str] = {}
    if isinstance(context, dg.AssetExecutionContext) or getattr(context, "has_assets_def", False):
        tags[TAG_ASSET_KEY] = context.asset_key.to_user_string()
    if context.has_partition_key:
        tags[TAG_PARTITION] = context.partition_key
    return tags


def _numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """MLflow-valid names → float values; non-numeric values (notes, lists) are skipped."""
    return {
        metric_name(name): float(value)
        for name, value in metrics.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def metric_name(name: str) -> str:
    """MLflow allows ``[\\w./ -]`` in metric and tag names; posttrain metrics use ``loss:sum``, ``pass@4`` style names."""
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
