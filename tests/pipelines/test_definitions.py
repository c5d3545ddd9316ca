"""The code location as a whole: asset-graph snapshot, jobs, and `dagster definitions validate`."""

import os
import subprocess
import sys
from pathlib import Path

from pipelines.definitions import build_definitions
from tests.fixtures.dagster_env import tiny_resources

REPO = Path(__file__).resolve().parents[2]

# key: (upstream keys, group, kinds, partitioned by, checks). Update deliberately when the graph changes.
ASSET_GRAPH = {
    "base_model": ([], "training", ["huggingface", "tinker"], None, []),
    "chat_dataset": ([], "data", ["huggingface", "parquet"], None, ["has_assistant_turns", "schema_valid"]),
    "rendered_tokens": (
        ["chat_dataset"], "data", ["parquet"], None, ["every_example_trained", "schema_valid", "within_max_length"]
    ),
    "sft_checkpoint": (["base_model", "rendered_tokens"], "training", ["mlflow", "tinker"], None, []),
    "eval_report": (
        ["chat_dataset", "rendered_tokens", "sft_checkpoint"], "eval", ["mlflow", "parquet", "tinker"], "checkpoints", ["improves_on_base"]
    ),
}


def test_asset_graph_snapshot(project_state):
    graph = build_definitions(tiny_resources(project_state)).resolve_asset_graph()
    snapshot = {}
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        snapshot[key.to_user_string()] = (
            sorted(parent.to_user_string() for parent in node.parent_keys),
            node.group_name,
            sorted(node.kinds),
            getattr(node.partitions_def, "name", None),
            sorted(check.name for check in node.check_keys),
        )
    assert snapshot == ASSET_GRAPH


def test_jobs_cover_each_stage_and_the_whole_chain(project_state):
    defs = build_definitions(tiny_resources(project_state))
    selections = {
        name: sorted(key.to_user_string() for key in defs.resolve_job_def(name).asset_layer.selected_asset_keys)
        for name in ("sft_data", "sft_train", "sft_eval", "sft_chain")
    }
    assert selections == {
        "sft_data": ["base_model", "chat_dataset", "rendered_tokens"],
        "sft_train": ["sft_checkpoint"],
        "sft_eval": ["eval_report"],
        "sft_chain": ["base_model", "chat_dataset", "rendered_tokens", "sft_checkpoint"],
    }


def test_every_config_field_has_a_default_and_a_description():
    from assets.base_model import BaseModelConfig
    from assets.checkpoints import SftConfig
    from assets.evals import EvalConfig

    for config in (BaseModelConfig, SftConfig, EvalConfig):
        for name, field in config.model_fields.items():
            assert not field.is_required(), f"{config.__name__}.{name} has no default"
            assert field.description, f"{config.__name__}.{name} has no description"


def test_dagster_definitions_validate_passes(tmp_path):
    env = {**os.environ, "POSTTRAIN_STATE_DIR": str(tmp_path / "state"), "DAGSTER_HOME": str(tmp_path / "home")}
    (tmp_path / "home").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "dagster", "definitions", "validate", "-m", "pipelines.definitions"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Validation successful" in result.stdout + result.stderr
