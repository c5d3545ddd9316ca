"""The SFT recipe family: jobs for each step and for the chain, the eval sensor and the re-eval schedule.

One factory, so the later recipes (DPO, RL, distillation) build the same machinery around their own
training asset: a job per stage, a whole-chain job, a sensor that evaluates every new checkpoint
partition, and a schedule that re-evaluates the newest ones.

Defaults, and why:
- the sensor is RUNNING: the point of the pipeline is that every checkpoint gets an eval report without
  anyone asking, and it only launches work when a training run has produced a new checkpoint;
- the schedule is STOPPED: evaluation is deterministic (greedy sampling, fixed held-out split), so
  re-evaluating an unchanged checkpoint repeats the same numbers and costs CPU on a 2-core machine.
  Turn it on when the eval code or data changes (the eval report's data version then moves) or when
  checkpoints come from a remote backend whose serving you want to monitor.

The whole-chain job stops at the training asset: eval reports are partitioned by checkpoints that
do not exist until training has run, so the sensor (or `python -m pipelines demo`) evaluates them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import dagster as dg

DEFAULT_REEVAL_CRON = "0 4 * * *"  # daily, at night
DEFAULT_REEVAL_NEWEST = 3


@dataclass(frozen=True)
class RecipeJobs:
    data: dg.UnresolvedAssetJobDefinition
    train: dg.UnresolvedAssetJobDefinition
    evaluate: dg.UnresolvedAssetJobDefinition
    chain: dg.UnresolvedAssetJobDefinition
    sensor: dg.SensorDefinition
    schedule: dg.ScheduleDefinition

    @property
    def jobs(self) -> list[dg.UnresolvedAssetJobDefinition]:
        return [self.data, self.train, self.evaluate, self.chain]


def build_recipe_jobs(
    recipe: str,
    data_assets: Sequence[str],
    training_asset: str,
    eval_asset: str,
    partitions: dg.DynamicPartitionsDefinition,
    reeval_cron: str = DEFAULT_REEVAL_CRON,
    reeval_newest: int = DEFAULT_REEVAL_NEWEST,
) -> RecipeJobs:
    """Jobs, sensor and schedule of one recipe, named ``<recipe>_data``, ``<recipe>_train``, ..."""
    data = dg.define_asset_job(
        f"{recipe}_data", selection=list(data_assets), description=f"{recipe}: base model and data assets."
    )
    train = dg.define_asset_job(
        f"{recipe}_train",
        selection=[training_asset],
        description=f"{recipe}: train on the materialized data; each checkpoint becomes a `{partitions.name}` partition.",
    )
    evaluate = dg.define_asset_job(
        f"{recipe}_eval",
        selection=[eval_asset],
        partitions_def=partitions,
        description=f"{recipe}: evaluate one checkpoint partition against the base model.",
    )
    chain = dg.define_asset_job(
        f"{recipe}_chain",
        selection=[*data_assets, training_asset],
        description=f"{recipe}: base model → data → training in one run; the eval sensor then evaluates each checkpoint.",
    )
    return RecipeJobs(
        data=data,
        train=train,
        evaluate=evaluate,
        chain=chain,
        sensor=new_checkpoint_sensor(f"{recipe}_evaluate_new_checkpoints", evaluate, partitions, eval_asset),
        schedule=reevaluate_newest_schedule(
            f"{recipe}_reevaluate_newest_checkpoints", evaluate, partitions, reeval_cron, reeval_newest
        ),
    )


def new_checkpoint_sensor(
    name: str, job: dg.UnresolvedAssetJobDefinition, partitions: dg.DynamicPartitionsDefinition, eval_asset: str
) -> dg.SensorDefinition:
    """One eval run per checkpoint partition not seen before; the cursor is the set of partitions seen.

    Partitions whose eval asset is already materialized (e.g. `make demo` evaluated them in-process
    before the daemon ever ran) count as seen, so turning on the UI does not repeat those evals.
    """

    @dg.sensor(
        name=name,
        job=job,
        minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Evaluates every new `{partitions.name}` partition once.",
    )
    def _sensor(context: dg.SensorEvaluationContext) -> Iterator[dg.RunRequest | dg.SkipReason]:
        seen = set(json.loads(context.cursor)) if context.cursor else set()
        current = context.instance.get_dynamic_partitions(partitions.name)
        evaluated = context.instance.get_materialized_partitions(dg.AssetKey(eval_asset))
        new = [key for key in current if key not in seen and key not in evaluated]
        if not new:
            yield dg.SkipReason(f"no new {partitions.name} partitions ({len(current)} known)")
            return
        for key in new:
            yield dg.RunRequest(run_key=f"evaluate:{key}", partition_key=key, tags={"posttrain/trigger": "new-checkpoint"})
        context.update_cursor(json.dumps(sorted(seen | set(current))))

    return _sensor


def reevaluate_newest_schedule(
    name: str,
    job: dg.UnresolvedAssetJobDefinition,
    partitions: dg.DynamicPartitionsDefinition,
    cron: str,
    newest: int,
) -> dg.ScheduleDefinition:
    """Re-evaluates the ``newest`` most recently added checkpoint partitions on ``cron``."""

    @dg.schedule(
        name=name,
        job=job,
        cron_schedule=cron,
        default_status=dg.DefaultScheduleStatus.STOPPED,
        description=f"Re-evaluates the {newest} newest `{partitions.name}` partitions (off by default: evals are deterministic).",
    )
    def _schedule(context: dg.ScheduleEvaluationContext) -> Iterator[dg.RunRequest | dg.SkipReason]:
        keys = context.instance.get_dynamic_partitions(partitions.name)[-newest:]
        if not keys:
            yield dg.SkipReason(f"no {partitions.name} partitions yet")
            return
        stamp = context.scheduled_execution_time.isoformat() if context.scheduled_execution_time else "manual"
        for key in reversed(keys):
            yield dg.RunRequest(
                run_key=f"reevaluate:{key}:{stamp}", partition_key=key, tags={"posttrain/trigger": "schedule"}
            )

    return _schedule
