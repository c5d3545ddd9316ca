"""The re-eval schedule against a real sqlite instance's dynamic partitions."""

import datetime

import dagster as dg

from pipelines.definitions import build_definitions
from tests.fixtures.dagster_env import tiny_resources

SCHEDULE = "sft_reevaluate_newest_checkpoints"


def _defs(state):
    return build_definitions(tiny_resources(state))


def test_schedule_reevaluates_the_three_newest_checkpoints_and_is_off_by_default(dagster_instance, project_state):
    schedule = _defs(project_state).resolve_schedule_def(SCHEDULE)
    assert schedule.default_status == dg.DefaultScheduleStatus.STOPPED
    assert schedule.job_name == "sft_eval"
    when = datetime.datetime(2026, 11, 22, 4, 0, tzinfo=datetime.timezone.utc)

    (skip,) = list(schedule(dg.build_schedule_context(instance=dagster_instance, scheduled_execution_time=when)))
    assert isinstance(skip, dg.SkipReason)

    keys = [f"sft-cccc-{step:06d}" for step in (10, 20, 30, 40)]
    dagster_instance.add_dynamic_partitions("sft_checkpoints", keys)
    requests = list(schedule(dg.build_schedule_context(instance=dagster_instance, scheduled_execution_time=when)))
    assert [r.partition_key for r in requests] == ["sft-cccc-000040", "sft-cccc-000030", "sft-cccc-000020"]
    assert len({r.run_key for r in requests}) == 3 and all(when.isoformat() in r.run_key for r in requests)
    later = when + datetime.timedelta(days=1)
    again = list(schedule(dg.build_schedule_context(instance=dagster_instance, scheduled_execution_time=later)))
    assert not {r.run_key for r in again} & {r.run_key for r in requests}  # a new tick re-evaluates
