"""Evaluate every new checkpoint once, automatically; never mark earlier reports stale."""

import dagster as dg
from dagster._core.definitions.data_version import StaleStatus
from dagster._utils.test.data_versions import get_stale_status_resolver  # what the UI's badge is computed by

from pipelines.definitions import AUTOMATION_SENSOR, build_definitions
from tests.fixtures.dagster_env import tiny_resources

EVAL = dg.AssetKey("sft_eval_report")


def _new_checkpoint(instance, key):
    instance.add_dynamic_partitions("sft_checkpoints", [key])
    instance.report_runless_asset_event(dg.AssetMaterialization(asset_key="sft_checkpoints", partition=key))


def test_each_new_checkpoint_is_requested_once_and_the_sensor_runs_by_default(dagster_instance, project_state):
    defs = build_definitions(tiny_resources(project_state))
    sensor = defs.resolve_sensor_def(AUTOMATION_SENSOR)
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    first = dg.evaluate_automation_conditions(defs=defs, instance=dagster_instance)
    assert first.total_requested == 0

    _new_checkpoint(dagster_instance, "sft-aaaa-000010")
    dagster_instance.add_dynamic_partitions("sft_checkpoints", ["sft-aaaa-000020"])  # registered, event not yet logged
    second = dg.evaluate_automation_conditions(defs=defs, instance=dagster_instance, cursor=first.cursor)
    assert second.get_requested_partitions(EVAL) == {"sft-aaaa-000010"}

    dagster_instance.report_runless_asset_event(dg.AssetMaterialization(asset_key="sft_checkpoints", partition="sft-aaaa-000020"))
    third = dg.evaluate_automation_conditions(defs=defs, instance=dagster_instance, cursor=second.cursor)
    assert third.get_requested_partitions(EVAL) == {"sft-aaaa-000020"}  # waited for its checkpoint, then once
    fourth = dg.evaluate_automation_conditions(defs=defs, instance=dagster_instance, cursor=third.cursor)
    assert fourth.total_requested == 0  # nothing twice, even while those evals are still missing


def test_a_new_training_run_does_not_make_earlier_reports_stale(dagster_instance, project_state):
    defs = build_definitions(tiny_resources(project_state))
    _new_checkpoint(dagster_instance, "sft-aaaa-000010")
    dagster_instance.report_runless_asset_event(dg.AssetMaterialization(asset_key="sft_checkpoint", tags={"dagster/data_version": "run-1"}))
    dagster_instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=EVAL, partition="sft-aaaa-000010"))
    for key in ("chat_dataset", "rendered_tokens"):
        dagster_instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=key))

    # A second training run (new data version of sft_checkpoint), and, as a control, new data.
    dagster_instance.report_runless_asset_event(dg.AssetMaterialization(asset_key="sft_checkpoint", tags={"dagster/data_version": "run-2"}))
    dagster_instance.report_runless_asset_event(dg.AssetMaterialization(asset_key="chat_dataset"))

    assets = list({id(node.assets_def): node.assets_def for node in defs.resolve_asset_graph().asset_nodes}.values())
    resolver = get_stale_status_resolver(dagster_instance, assets)
    assert resolver.get_status(EVAL, "sft-aaaa-000010") == StaleStatus.FRESH
    assert resolver.get_status(dg.AssetKey("rendered_tokens")) == StaleStatus.STALE  # the resolver does see staleness
