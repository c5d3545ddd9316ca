"""Each recipe's jobs: data, train, eval (partitioned), whole chain, and an off-by-default re-eval schedule.

One factory for every recipe (SFT, DPO, RL, code RL, distillation): the recipe module passes only its
asset names. Evaluating every new checkpoint is not a job's business: each eval report asset carries an
``on_missing`` automation condition, run by the automation sensor in ``pipelines.definitions``.

The re-eval schedule is STOPPED by default: evaluation is deterministic (greedy sampling, fixed held-out
split, exact data versions), so re-evaluating an unchanged checkpoint repeats the same numbers at CPU
cost. Turn it on when the eval code changes or checkpoints come from a backend whose serving you monitor.

The whole-chain job stops at the training asset: eval reports are partitioned by checkpoints that do
not exist until training has run, so automation (or `python -m pipelines demo`) evaluates them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import dagster as dg

from assets.evals import EvalSpec

DEFAULT_REEVAL_CRON = "0 4 * * *"  # daily, at night
DEFAULT_REEVAL_NEWEST = 3


# Every recipe job runs its steps in the run's own process by default. Its steps form a chain (data, then
# training, then outputs), so a process per step buys no parallelism, and each such process re-imports the
# code location (torch, transformers, MLflow: seconds each) — most of Dagster's overhead over a
# plain script (bench/bench_dagster_overhead.py). A re-execution from failure resumes training either way.
# Only the default: the launchpad can still pick `execution: {config: {multiprocess: {}}}`. The partitioned
# eval jobs keep Dagster's default (a default run config is not applied to them here; one step each anyway).
IN_PROCESS_DEFAULT = {"execution": {"config": {"in_process": {}}}}


@dataclass(frozen=True)
class RecipeJobs:
    data: dg.UnresolvedAssetJobDefinition
    train: dg.UnresolvedAssetJobDefinition
    evaluate: dg.UnresolvedAssetJobDefinition
    chain: dg.UnresolvedAssetJobDefinition
    schedule: dg.ScheduleDefinition
    variant_chains: tuple[dg.UnresolvedAssetJobDefinition, ...] = ()

    @property
    def jobs(self) -> list[dg.UnresolvedAssetJobDefinition]:
        return [self.data, self.train, self.evaluate, self.chain, *self.variant_chains]


@dataclass(frozen=True)
class ChainVariant:
    """Another whole-chain job of a recipe: other data assets, and the op config defaults that pick them
    (e.g. DPO on offline pairs: ``dpo_offline_chain``). Its defaults show in the launchpad and can be edited;
    build ``op_defaults`` with :func:`whole_op_defaults` so the scaffold keeps every other field."""

    name: str
    data_assets: Sequence[str]
    op_defaults: Mapping[str, Mapping[str, object]]
    description: str


def whole_op_defaults(
    assets: Sequence[dg.AssetsDefinition], overrides: Mapping[str, Mapping[str, object]]
) -> dict[str, dict[str, object]]:
    """Each op's whole default config with ``overrides`` on top.

    A job config that pins a few fields of an op becomes that op's *entire* default in the launchpad:
    "Scaffold all default config" would show only the pinned fields (no learning rate to edit).
    Unset (None) defaults are left out, as Dagster's own scaffold leaves them out.
    """
    by_name = {asset.key.to_user_string(): asset for asset in assets}
    whole = {}
    for op, values in overrides.items():
        defaults = by_name[op].op.config_field.default_value
        whole[op] = {**{key: value for key, value in defaults.items() if value is not None}, **values}
    return whole


def build_recipe_jobs(
    spec: EvalSpec,
    data_assets: Sequence[str],
    reeval_cron: str = DEFAULT_REEVAL_CRON,
    reeval_newest: int = DEFAULT_REEVAL_NEWEST,
    outputs: Sequence[str] = (),
    variants: Sequence[ChainVariant] = (),
) -> RecipeJobs:
    """Jobs and schedule of one recipe, named ``<recipe>_data``, ``<recipe>_train``, ``<recipe>_eval``, ``<recipe>_chain``.

    ``outputs``: unpartitioned assets made from a training run (e.g. RL's ``rollout_batches``), materialized
    right after the training asset by the train and chain jobs.
    """
    recipe, training_asset, eval_asset = spec.training.recipe, spec.training.asset_name, spec.asset_name
    partitions = spec.training.partitions
    data = dg.define_asset_job(
        f"{recipe}_data", selection=list(data_assets), description=f"{recipe}: base model and data assets.", config=IN_PROCESS_DEFAULT
    )
    train = dg.define_asset_job(
        f"{recipe}_train",
        config=IN_PROCESS_DEFAULT,
        selection=[training_asset, *outputs],
        description=f"{recipe}: train on the materialized data; each checkpoint becomes a `{partitions.name}` partition.",
    )
    evaluate = dg.define_asset_job(
        f"{recipe}_eval",
        selection=[eval_asset],
        partitions_def=partitions,
        description=f"{recipe}: evaluate one checkpoint partition against its base model and its parent.",
    )
    chain = dg.define_asset_job(
        f"{recipe}_chain",
        config=IN_PROCESS_DEFAULT,
        selection=[*data_assets, training_asset, *outputs],
        description=f"{recipe}: base model → data → training in one run; automation then evaluates each checkpoint.",
    )
    variant_chains = tuple(
        dg.define_asset_job(
            f"{recipe}_{variant.name}_chain",
            config={**IN_PROCESS_DEFAULT, "ops": {op: {"config": dict(values)} for op, values in variant.op_defaults.items()}},
            selection=[*variant.data_assets, training_asset, *outputs],
            description=f"{recipe}: {variant.description}",
        )
        for variant in variants
    )
    return RecipeJobs(
        data=data,
        train=train,
        evaluate=evaluate,
        chain=chain,
        variant_chains=variant_chains,
        schedule=reevaluate_newest_schedule(
            f"{recipe}_reevaluate_newest_checkpoints", evaluate, partitions, reeval_cron, reeval_newest
        ),
    )


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
