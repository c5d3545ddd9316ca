"""The eval sensor and the re-eval schedule against a real sqlite instance's dynamic partitions."""

import datetime
import json

import dagster as dg

from pipelines.definitions import build_definitions
from tests.fixtures.dagster_env import tiny_resources

SENSOR = "sft_evaluate_new_checkpoints"
SCHEDULE = "sft_reevaluate_newest_checkpoints"


def _defs(state):
    return build_definitions(tiny_resources(state))


def test_sensor_requests_one_eval_per_new_checkpoint_and_remembers_them(dagster_instance, project_state):
    sensor = _defs(project_state).resolve_sensor_def(SENSOR)
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    assert sensor.job_name == "sft_eval"

    context = dg.build_sensor_context(instance=dagster_instance)
    (skip,) = list(sensor(context))
    assert isinstance(skip, dg.SkipReason)

    dagster_instance.add_dynamic_partitions("checkpoints", ["sft-aaaa-000010", "sft-aaaa-000020"])
    context = dg.build_sensor_context(instance=dagster_instance, cursor=context.cursor)
    requests = list(sensor(context))
    assert [(r.partition_key, r.run_key) for r in requests] == [
        ("sft-aaaa-000010", "evaluate:sft-aaaa-000010"),
        ("sft-aaaa-000020", "evaluate:sft-aaaa-000020"),
    ]
    assert json.loads(context.cursor) == ["sft-aaaa-000010", "sft-aaaa-000020"]

    context = dg.build_sensor_context(instance=dagster_instance, cursor=context.cursor)
    assert all(isinstance(r, dg.SkipReason) for r in sensor(context))

    dagster_instance.add_dynamic_partitions("checkpoints", ["sft-bbbb-000010"])
    context = dg.build_sensor_context(instance=dagster_instance, cursor=context.cursor)
    assert [r.partition_key for r in sensor(context)] == ["sft-bbbb-000010"]


def test_sensor_skips_checkpoints_already_evaluated_outside_the_daemon(dagster_instance, project_state):
    # `make demo` evaluates its checkpoints in-process; starting `make ui` afterwards must not redo them.
    sensor = _defs(project_state).resolve_sensor_def(SENSOR)
    dagster_instance.add_dynamic_partitions("checkpoints", ["sft-cccc-000010", "sft-cccc-000020"])
    dagster_instance.report_runless_asset_event(
        dg.AssetMaterialization(asset_key="eval_report", partition="sft-cccc-000010")
    )

    context = dg.build_sensor_context(instance=dagster_instance)
    assert [r.partition_key for r in sensor(context)] == ["sft-cccc-000020"]
    context = dg.build_sensor_context(instance=dagster_instance, cursor=context.cursor)
    assert all(isinstance(r, dg.SkipReason) for r in sensor(context))


def test_schedule_reevaluates_the_three_newest_checkpoints_and_is_off_by_default(dagster_instance, project_state):
    schedule = _defs(project_state).resolve_schedule_def(SCHEDULE)
    assert schedule.default_status == dg.DefaultScheduleStatus.STOPPED
    assert schedule.job_name == "sft_eval"
    when = datetime.datetime(2026, 11, 22, 4, 0, tzinfo=datetime.timezone.utc)

    (skip,) = list(schedule(dg.build_schedule_context(instance=dagster_instance, scheduled_execution_time=when)))
    assert isinstance(skip, dg.SkipReason)

    keys = [f"sft-cccc-{step:06d}" for step in (10, 20, 30, 40)]
    dagster_instance.add_dynamic_partitions("checkpoints", keys)
    requests = list(schedule(dg.build_schedule_context(instance=dagster_instance, scheduled_execution_time=when)))
    assert [r.partition_key for r in requests] == ["sft-cccc-000040", "sft-cccc-000030", "sft-cccc-000020"]
    assert len({r.run_key for r in requests}) == 3 and all(when.isoformat() in r.run_key for r in requests)
    later = when + datetime.timedelta(days=1)
    again = list(schedule(dg.build_schedule_context(instance=dagster_instance, scheduled_execution_time=later)))
    assert not {r.run_key for r in again} & {r.run_key for r in requests}  # a new tick re-evaluates
