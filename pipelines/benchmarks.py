"""Benchmark automation: the job, the new-checkpoint sensor, the daily schedule, and the leaderboard's sensor.

What runs is the configured suite (:class:`BenchmarkSuite`, from the environment):
- ``POSTTRAIN_BENCHMARKS`` — comma-separated benchmark names (default
  ``arithmetic_gsm8k,arithmetic_choice,gsm8k,mmlu``: the first two are generated, so a fresh offline clone
  always has a suite to run);
- ``POSTTRAIN_BENCHMARK_TRIGGER`` — ``best`` (default: a checkpoint that becomes its recipe's MLflow
  ``best``) or ``every`` (every new checkpoint);
- ``POSTTRAIN_BENCHMARK_LIMIT`` — samples per benchmark for automatic runs (default 100; 0 = all).

A benchmark whose dataset is not here (no ``POSTTRAIN_HUB_MIRROR`` copy, nothing in the HF cache) is not
requested: automation never launches a run that would fail for want of data, or download it unseen. The
sensor and the schedule name it, with both fixes, in a warning and in their skip reason; once the data is
there, the next evaluation requests it.

A benchmarked checkpoint brings its parent and its base model along (each once), so the leaderboard
always has the rows it compares against. Every (model, benchmark) pair is requested once: its partition
of ``benchmark_result`` is added when it is requested, and a key that exists is never requested again
(re-materialize it by hand). Runs carry the ``tinker`` pool (on the asset), like training runs.

- sensor ``benchmark_new_checkpoints`` (running by default): the trigger above;
- schedule ``benchmark_newest_checkpoints`` (daily, running by default): the newest checkpoint of each
  recipe that has not been benchmarked yet;
- sensor ``update_leaderboard``: the leaderboard's ``eager`` condition, after every new result.
"""

import json
import math
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import dagster as dg

from assets.benchmarks import BASE_PREFIX, BENCHMARK_ASSETS, BENCHMARK_PARTITIONS, BenchmarkKey, base_key, benchmark_result, ensure_partitions, leaderboard
from assets.checkpoint_manifest import CheckpointManifest, all_manifests
from assets.registration import partitions_name
from pipelines.best import best_manifests
from posttrain.benchmarks.tasks import benchmark_names, data_missing, is_task_reference
from resources.mlflow import MlflowResource

BENCHMARK_JOB = "benchmark"
DAILY_CRON = "0 5 * * *"
TRIGGERS = ("best", "every")
DEFAULT_BENCHMARKS = ("arithmetic_gsm8k", "arithmetic_choice", "gsm8k", "mmlu")


@dataclass(frozen=True)
class BenchmarkSuite:
    benchmarks: tuple[str, ...] = DEFAULT_BENCHMARKS
    trigger: str = "best"
    limit: int = 100

    @classmethod
    def from_env(cls) -> "BenchmarkSuite":
        names = tuple(name.strip() for name in os.environ.get("POSTTRAIN_BENCHMARKS", ",".join(DEFAULT_BENCHMARKS)).split(",") if name.strip())
        trigger = os.environ.get("POSTTRAIN_BENCHMARK_TRIGGER", "best")
        if trigger not in TRIGGERS:
            raise ValueError(f"POSTTRAIN_BENCHMARK_TRIGGER={trigger!r}: use one of {TRIGGERS}")
        return cls(names, trigger, int(os.environ.get("POSTTRAIN_BENCHMARK_LIMIT", "100")))

    def run_config(self) -> dict:
        return {"ops": {benchmark_result.key.to_python_identifier(): {"config": {"limit": self.limit}}}}

    def keys_for(self, manifest: CheckpointManifest, benchmarks: tuple[str, ...] | None = None) -> list[BenchmarkKey]:
        """The checkpoint, its parent and its base model, each on every benchmark of the suite (or of ``benchmarks``)."""
        models = [manifest.partition, *([manifest.parent_partition] if manifest.parent_partition else []), base_key(manifest.base_model)]
        return [BenchmarkKey(model, benchmark) for model in models for benchmark in (self.benchmarks if benchmarks is None else benchmarks)]

    def missing_data(self) -> dict[str, str]:
        """Each name of the suite that cannot run here, with why and the fix: no such benchmark, or its
        dataset is not here (the message names it and both fixes)."""
        return {name: why for name in self.benchmarks if (why := _cannot_run(name)) is not None}


def _cannot_run(name: str) -> str | None:
    if not is_task_reference(name):
        return (f"{name!r} is no benchmark; fix POSTTRAIN_BENCHMARKS: use {', '.join(benchmark_names())}, "
                "inspect_evals/<task> or a path to a .py task file")
    return data_missing(name)


def benchmark_job() -> "dg.UnresolvedAssetJobDefinition":
    return dg.define_asset_job(
        BENCHMARK_JOB, selection=[benchmark_result], partitions_def=BENCHMARK_PARTITIONS,
        description="Benchmark one (model, benchmark) partition through inspect-ai.",
    )


@dataclass(frozen=True)
class Plan:
    requests: list[dg.RunRequest]
    left_out: list[str]  # one line per benchmark not requested for want of its data: what and how to fix

    def skip_reason(self, nothing_new: str) -> dg.SkipReason:
        return dg.SkipReason("; ".join([nothing_new, *self.left_out]))


def run_requests(instance: dg.DagsterInstance, suite: BenchmarkSuite, manifests: list[CheckpointManifest], trigger: str) -> Plan:
    """Adds the partitions not requested before, on the benchmarks whose data is here, and returns one run
    request for each; a benchmark without its data is left out (and named) while it has pairs to run."""
    missing = suite.missing_data()
    runnable = tuple(name for name in suite.benchmarks if name not in missing)
    keys = [key for manifest in manifests for key in suite.keys_for(manifest, runnable)]
    requests = [
        dg.RunRequest(
            run_key=f"benchmark:{key.partition}", partition_key=key.partition, run_config=suite.run_config(),
            tags={"posttrain/trigger": trigger},
        )
        for key in ensure_partitions(instance, keys)
    ]
    left_out = []
    for name, why in missing.items():
        pending = {key.model for manifest in manifests for key in suite.keys_for(manifest, (name,))
                   if not instance.has_dynamic_partition(BENCHMARK_PARTITIONS.name, key.partition)}
        if pending:
            left_out.append(f"{name} not requested for {len(pending)} model(s): {why}")
    return Plan(requests, left_out)


def new_checkpoint_sensor(suite: BenchmarkSuite, job: "dg.UnresolvedAssetJobDefinition") -> dg.SensorDefinition:
    @dg.sensor(
        name="benchmark_new_checkpoints",
        job=job,
        minimum_interval_seconds=60,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Benchmarks ({', '.join(suite.benchmarks)}) each checkpoint that becomes its recipe's `best`"
        " (or every new checkpoint: POSTTRAIN_BENCHMARK_TRIGGER=every), with its parent and base model;"
        " a benchmark whose dataset is not local is left out and named in the skip reason.",
    )
    def _sensor(context: dg.SensorEvaluationContext, mlflow: MlflowResource) -> Iterator[dg.RunRequest | dg.SkipReason]:
        manifests = [manifest for manifest in all_manifests() if manifest.sampler_path]
        if suite.trigger == "best":
            manifests = best_manifests(manifests, mlflow)
        plan = run_requests(context.instance, suite, manifests, f"sensor:{suite.trigger}")
        for line in plan.left_out:
            context.log.warning(line)
        if not plan.requests:
            yield plan.skip_reason(f"no new checkpoint to benchmark ({len(manifests)} candidate(s) already requested)")
        yield from plan.requests

    return _sensor


def newest_checkpoint_schedule(suite: BenchmarkSuite, job: "dg.UnresolvedAssetJobDefinition") -> dg.ScheduleDefinition:
    @dg.schedule(
        name="benchmark_newest_checkpoints",
        job=job,
        cron_schedule=DAILY_CRON,
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description=f"Daily: benchmarks ({', '.join(suite.benchmarks)}) the newest checkpoint of each recipe not benchmarked yet"
        " (a benchmark whose dataset is not local is left out and named in the skip reason).",
    )
    def _schedule(context: dg.ScheduleEvaluationContext) -> Iterator[dg.RunRequest | dg.SkipReason]:
        plan = run_requests(context.instance, suite, newest_per_recipe(context.instance), "schedule")
        for line in plan.left_out:
            context.log.warning(line)
        if not plan.requests:
            yield plan.skip_reason("the newest checkpoint of every recipe is benchmarked already")
        yield from plan.requests

    return _schedule


def newest_per_recipe(instance: dg.DagsterInstance) -> list[CheckpointManifest]:
    """Each recipe's most recently added checkpoint partition that has sampler weights."""
    by_partition = {manifest.partition: manifest for manifest in all_manifests() if manifest.sampler_path}
    newest = []
    for recipe in sorted({manifest.recipe for manifest in by_partition.values()}):
        keys = [key for key in instance.get_dynamic_partitions(partitions_name(recipe)) if key in by_partition]
        if keys:
            newest.append(by_partition[keys[-1]])
    return newest


def leaderboard_sensor() -> dg.AutomationConditionSensorDefinition:
    return dg.AutomationConditionSensorDefinition(
        "update_leaderboard",
        target=dg.AssetSelection.assets(leaderboard),
        default_status=dg.DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=30,
        description="Refreshes the leaderboard after new benchmark results (its eager condition).",
    )


def benchmark_definitions(suite: BenchmarkSuite | None = None) -> dg.Definitions:
    suite = suite or BenchmarkSuite.from_env()
    job = benchmark_job()
    return dg.Definitions(
        assets=BENCHMARK_ASSETS,
        jobs=[job],
        sensors=[new_checkpoint_sensor(suite, job), leaderboard_sensor()],
        schedules=[newest_checkpoint_schedule(suite, job)],
    )


# -- the `python -m pipelines benchmark` command -------------------------------------------------------

CHECKPOINT_REFERENCE = re.compile(r"^(tinker://.*|[^/\s]+/\d+|[a-z_]+-[0-9a-f]{8}-.+)$")


def model_key(reference: str, instance: dg.DagsterInstance) -> str:
    """A checkpoint reference (as ``lineage`` takes it) → its partition key; anything else is a base model name."""
    from pipelines.lineage import resolve_reference

    if reference.startswith(BASE_PREFIX):
        return reference
    try:
        return resolve_reference(reference, MlflowResource().get_client()).partition
    except LookupError as error:
        if CHECKPOINT_REFERENCE.match(reference):
            raise LookupError(f"checkpoint {reference!r} does not exist: {error}") from error
    return base_key(reference)


def run_cli(reference: str | None, tasks: list[str], limit: int, max_tokens: int, task_args: dict[str, object], show_leaderboard: bool = False) -> int:
    """Benchmarks ``reference`` on each task through the ``benchmark_result`` asset (one JSON line per task),
    then, with ``show_leaderboard``, materializes the leaderboard and prints it."""
    from pipelines.definitions import default_resources

    if not tasks and not show_leaderboard:
        print("error: name at least one --task (or ask for --leaderboard)", file=sys.stderr)
        return 2
    if tasks and not reference:
        print("error: name the checkpoint or base model to benchmark", file=sys.stderr)
        return 2
    with dg.DagsterInstance.get() as instance:
        status = _benchmark_tasks(instance, reference, tasks, limit, max_tokens, task_args) if tasks else 0
        if show_leaderboard:
            try:
                metadata = refresh_leaderboard(instance, default_resources()["mlflow"])
            except RuntimeError as error:
                print(f"error: {error}", file=sys.stderr)
                return 2
            print(metadata["leaderboard"])
            print(f"chart: {metadata['chart']}")
        return status


def refresh_leaderboard(
    instance: dg.DagsterInstance, mlflow: MlflowResource, tags: dict[str, str] | None = None, run_config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Materializes ``leaderboard`` and returns its metadata values (``leaderboard`` markdown, ``chart`` and
    ``table`` paths); a failed run raises RuntimeError with the reason. ``run_config``: e.g. the console log level."""
    outcome = dg.materialize(
        [leaderboard], instance=instance, resources={"mlflow": mlflow}, raise_on_error=False, tags=tags, run_config=run_config
    )
    if not outcome.success:
        raise RuntimeError(f"leaderboard: {failure_message(outcome)}")
    return {name: getattr(value, "value", value) for name, value in outcome.asset_materializations_for_node("leaderboard")[0].metadata.items()}


def _benchmark_tasks(instance: dg.DagsterInstance, reference: str, tasks: list[str], limit: int, max_tokens: int, task_args: dict[str, object]) -> int:
    from pipelines.definitions import default_resources

    try:
        model = model_key(reference, instance)
    except LookupError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    resources = {name: value for name, value in default_resources().items() if name in ("tinker", "mlflow")}
    config = {"limit": limit, "max_tokens": max_tokens, "task_args": json.dumps(task_args)}
    failed = 0
    for task in tasks:
        key = BenchmarkKey(model, task)
        added = ensure_partitions(instance, [key])
        outcome = dg.materialize(
            [benchmark_result], partition_key=key.partition, instance=instance, resources=resources,
            run_config={"ops": {"benchmark_result": {"config": config}}}, raise_on_error=False,
            tags={"posttrain/trigger": "cli"},
        )
        if not outcome.success:
            if added:  # a failed first run records nothing, not even the requested key
                instance.delete_dynamic_partition(BENCHMARK_PARTITIONS.name, key.partition)
            print(f"error: {task}: {failure_message(outcome)}", file=sys.stderr)
            failed += 1
            continue
        metadata = {name: getattr(value, "value", value) for name, value in outcome.asset_materializations_for_node("benchmark_result")[0].metadata.items()}
        print(json.dumps({
            "task": task, "model": model, "metric": metadata["metric"], "value": metadata["value"],
            "stderr": None if math.isnan(metadata["stderr"]) else metadata["stderr"], "n": metadata["n"],
            "log": metadata["inspect_log"], "view": metadata["view"],
        }), flush=True)
    return 2 if failed else 0


def failure_message(outcome: "dg.ExecuteInProcessResult") -> str:
    for event in outcome.all_events:
        if event.is_step_failure and event.step_failure_data.error is not None:
            error = event.step_failure_data.error
            while error.cause is not None and error.message.startswith(("dagster._core.errors.DagsterExecutionStepExecutionError", "Error occurred while")):
                error = error.cause
            return error.message.strip()
    return "the run failed (see the Dagster run log)"


def parse_task_args(pairs: list[str]) -> dict[str, object]:
    """``-T name=value`` pairs; a value that parses as JSON (numbers, true/false) is taken as such."""
    args: dict[str, object] = {}
    for pair in pairs:
        name, separator, value = pair.partition("=")
        if not separator or not name:
            raise SystemExit(f"error: -T {pair!r}: write -T name=value")
        try:
            args[name] = json.loads(value)
        except json.JSONDecodeError:
            args[name] = value
    return args
