"""The training-asset factory refuses tokens rendered with another tokenizer than the model it trains."""

import dagster as dg

from assets.checkpoint_manifest import all_manifests
from pipelines.definitions import build_definitions
from tests.fixtures.dagster_env import TINY_CHAIN_CONFIG, tiny_resources


def test_training_refuses_tokens_of_another_tokenizer_naming_both(dagster_instance, project_state):
    defs = build_definitions(tiny_resources(project_state))
    data_config = {"ops": {k: v for k, v in TINY_CHAIN_CONFIG["ops"].items() if k != "sft_checkpoint"}}
    assert defs.resolve_job_def("sft_data").execute_in_process(instance=dagster_instance, run_config=data_config).success
    # base_model is re-materialized as another model after the tokens were rendered.
    dagster_instance.report_runless_asset_event(
        dg.AssetMaterialization(
            asset_key="base_model",
            metadata={"base_model": "other/model", "tokenizer_name": "other/model", "tokenizer_digest": "0" * 64},
        )
    )
    result = defs.resolve_job_def("sft_train").execute_in_process(
        instance=dagster_instance, raise_on_error=False, run_config={"ops": {"sft_checkpoint": TINY_CHAIN_CONFIG["ops"]["sft_checkpoint"]}}
    )
    assert not result.success
    message = result.failure_data_for_node("sft_checkpoint").user_failure_data.description
    assert "rendered_tokens" in message and "localtinker/tiny-random" in message and "other/model" in message
    assert "re-materialize rendered_tokens after base_model" in message
    assert dagster_instance.get_dynamic_partitions("sft_checkpoints") == [] and all_manifests() == []
