"""The code location as a whole: asset-graph snapshot, jobs, and `dagster definitions validate`."""

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg

from assets.code_rl import CODE_RL
from assets.distill import DISTILL, PROMPT_DISTILL
from assets.dpo import DPO
from assets.preference_model import PREFERENCE_MODEL
from assets.rl import RL
from assets.rlhf import RLHF
from assets.sft import SFT
from assets.training import training_config_class
from pipelines.definitions import build_definitions
from tests.fixtures.dagster_env import tiny_resources

REPO = Path(__file__).resolve().parents[2]
TRAINING_SPECS = (SFT, RL, CODE_RL, DISTILL, PROMPT_DISTILL, DPO, PREFERENCE_MODEL, RLHF)  # every recipe's TrainingSpec: their launchpad configs are checked below

# key: (upstream keys, group, kinds, partitioned by, checks). Update deliberately when the graph changes.
ASSET_GRAPH = {
    "base_model": ([], "training", ["huggingface", "tinker"], None, []),
    "chat_dataset": ([], "data", ["huggingface", "parquet"], None, ["has_assistant_turns", "schema_valid"]),
    "code_problems": ([], "data", ["huggingface", "parquet"], None, ["has_tests", "schema_valid"]),
    "preference_comparisons": ([], "data", ["huggingface", "parquet"], None, ["pairs_differ", "schema_valid"]),
    "preference_pairs": (
        ["base_model", "preference_comparisons"], "data", ["parquet"], None,
        ["pairs_differ_and_share_prompt", "schema_valid", "within_max_length"],
    ),
    "rendered_tokens": (
        ["base_model", "chat_dataset"], "data", ["parquet"], None, ["every_example_trained", "schema_valid", "within_max_length"]
    ),
    "rl_problems": ([], "data", ["huggingface", "parquet"], None, ["gold_answers_verified", "schema_valid"]),
    "sft_checkpoint": (["base_model", "rendered_tokens"], "training", ["mlflow", "tinker"], None, []),
    "sft_checkpoints": (["sft_checkpoint"], "training", ["tinker"], "sft_checkpoints", []),
    "sft_eval_report": (["sft_checkpoints"], "eval", ["mlflow", "parquet", "tinker"], "sft_checkpoints", ["improves_on_base"]),
    "rl_checkpoint": (["base_model", "dpo_checkpoint", "rl_problems", "sft_checkpoint"], "training", ["mlflow", "tinker"], None, []),
    "rl_checkpoints": (["rl_checkpoint"], "training", ["tinker"], "rl_checkpoints", []),
    "rl_eval_report": (["rl_checkpoints"], "eval", ["mlflow", "parquet", "tinker"], "rl_checkpoints", ["improves_on_base"]),
    "rollout_batches": (["rl_checkpoint"], "training", ["mlflow", "parquet"], None, []),
    "distill_checkpoint": (
        ["base_model", "chat_dataset", "dpo_checkpoint", "preference_comparisons", "rl_checkpoint", "rl_problems", "sft_checkpoint"],
        "training", ["mlflow", "tinker"], None, [],
    ),
    "distill_checkpoints": (["distill_checkpoint"], "training", ["tinker"], "distill_checkpoints", []),
    "distill_eval_report": (["distill_checkpoints"], "eval", ["mlflow", "parquet", "tinker"], "distill_checkpoints", ["improves_on_base"]),
    "teacher_responses": (
        ["base_model", "chat_dataset", "preference_comparisons", "rl_checkpoint", "rl_problems", "sft_checkpoint"], "data",
        ["parquet", "tinker"], None,
        ["answers_not_empty", "has_assistant_turns", "schema_valid"],
    ),
    "prompt_distill_checkpoint": (
        ["base_model", "dpo_checkpoint", "rl_checkpoint", "sft_checkpoint", "teacher_responses"], "training", ["mlflow", "tinker"], None, []
    ),
    "prompt_distill_checkpoints": (["prompt_distill_checkpoint"], "training", ["tinker"], "prompt_distill_checkpoints", []),
    "prompt_distill_eval_report": (
        ["prompt_distill_checkpoints"], "eval", ["mlflow", "parquet", "tinker"], "prompt_distill_checkpoints", ["improves_on_base"]
    ),
    "code_rl_checkpoint": (
        ["base_model", "code_problems", "distill_checkpoint", "dpo_checkpoint", "prompt_distill_checkpoint", "rl_checkpoint", "sft_checkpoint"],
        "training", ["mlflow", "tinker"], None, [],
    ),
    "code_rl_checkpoints": (["code_rl_checkpoint"], "training", ["tinker"], "code_rl_checkpoints", []),
    "code_rl_eval_report": (
        ["code_rl_checkpoints"], "eval", ["mlflow", "parquet", "tinker"], "code_rl_checkpoints", ["improves_on_base"]
    ),
    "onpolicy_comparisons": (
        ["base_model", "rl_problems", "sft_checkpoint"], "data", ["parquet", "tinker"], None, ["has_pairs", "pairs_differ", "schema_valid"]
    ),
    "onpolicy_pairs": (
        ["base_model", "onpolicy_comparisons"], "data", ["parquet"], None,
        ["pairs_differ_and_share_prompt", "schema_valid", "within_max_length"],
    ),
    "reference_logprobs": (
        ["base_model", "onpolicy_pairs", "preference_pairs", "sft_checkpoint"], "data", ["parquet", "tinker"], None, ["finite", "schema_valid"]
    ),
    "dpo_checkpoint": (
        ["base_model", "onpolicy_pairs", "preference_pairs", "reference_logprobs", "sft_checkpoint"], "training",
        ["mlflow", "tinker"], None, [],
    ),
    "dpo_checkpoints": (["dpo_checkpoint"], "training", ["tinker"], "dpo_checkpoints", []),
    "dpo_eval_report": (["dpo_checkpoints"], "eval", ["mlflow", "parquet", "tinker"], "dpo_checkpoints", ["improves_on_base"]),
    "benchmark_result": ([], "benchmarks", ["mlflow", "parquet", "tinker"], "benchmark_runs", []),
    "leaderboard": (["benchmark_result"], "benchmarks", ["mlflow", "parquet"], None, []),
    "preference_model_checkpoint": (
        ["base_model", "onpolicy_comparisons", "preference_comparisons", "sft_checkpoint"], "training", ["mlflow", "tinker"], None, [],
    ),
    "preference_model_checkpoints": (["preference_model_checkpoint"], "training", ["tinker"], "preference_model_checkpoints", []),
    "preference_model_eval_report": (
        ["preference_model_checkpoints"], "eval", ["mlflow", "parquet", "tinker"], "preference_model_checkpoints", ["improves_on_base"]
    ),
    "rlhf_checkpoint": (
        ["base_model", "onpolicy_comparisons", "preference_comparisons", "preference_model_checkpoint", "rl_problems", "sft_checkpoint"],
        "training", ["mlflow", "tinker"], None, [],
    ),
    "rlhf_checkpoints": (["rlhf_checkpoint"], "training", ["tinker"], "rlhf_checkpoints", []),
    "rlhf_eval_report": (["rlhf_checkpoints"], "eval", ["mlflow", "parquet", "tinker"], "rlhf_checkpoints", ["improves_on_base"]),
    "rlhf_rollout_batches": (["rlhf_checkpoint"], "training", ["mlflow", "parquet"], None, []),
    "sft_export": (["sft_checkpoints"], "export", ["huggingface", "mlflow", "tinker"], "sft_checkpoints", []),
    "rl_export": (["rl_checkpoints"], "export", ["huggingface", "mlflow", "tinker"], "rl_checkpoints", []),
    "code_rl_export": (["code_rl_checkpoints"], "export", ["huggingface", "mlflow", "tinker"], "code_rl_checkpoints", []),
    "distill_export": (["distill_checkpoints"], "export", ["huggingface", "mlflow", "tinker"], "distill_checkpoints", []),
    "prompt_distill_export": (["prompt_distill_checkpoints"], "export", ["huggingface", "mlflow", "tinker"], "prompt_distill_checkpoints", []),
    "dpo_export": (["dpo_checkpoints"], "export", ["huggingface", "mlflow", "tinker"], "dpo_checkpoints", []),
    "preference_model_export": (["preference_model_checkpoints"], "export", ["huggingface", "mlflow", "tinker"], "preference_model_checkpoints", []),
    "rlhf_export": (["rlhf_checkpoints"], "export", ["huggingface", "mlflow", "tinker"], "rlhf_checkpoints", []),
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


def test_a_training_asset_has_table_edges_only_to_the_tables_it_may_read(project_state):
    """Every data-table edge into a training asset is a table it reads: a fixed input, the launchpad's choice
    among tables, or DPO's shared reference logprobs; other edges are checkpoints it may start from or learn from."""
    graph = build_definitions(tiny_resources(project_state)).resolve_asset_graph()
    for spec in TRAINING_SPECS:
        parents = {key.to_user_string() for key in graph.get(dg.AssetKey(spec.asset_name)).parent_keys}
        tables = {name for name in parents if not name.endswith("_checkpoint") and name != "base_model"}
        readable = set(spec.ins) | set(spec.input_choice[1] if spec.input_choice else ()) | (set(spec.extra_deps) - {
            name for name in spec.extra_deps if name.endswith("_checkpoint")})
        assert tables == readable, spec.recipe
        assert set(spec.parent_assets) <= parents, spec.recipe
    assert "rl_problems" not in {k.to_user_string() for k in graph.get(dg.AssetKey("dpo_checkpoint")).parent_keys}


def test_jobs_cover_each_stage_and_the_whole_chain(project_state):
    defs = build_definitions(tiny_resources(project_state))
    selections = {
        name: sorted(key.to_user_string() for key in defs.resolve_job_def(name).asset_layer.selected_asset_keys)
        for name in ("sft_data", "sft_train", "sft_eval", "sft_chain", "rl_data", "rl_train", "rl_eval", "rl_chain",
                     "preference_model_chain", "rlhf_train", "rlhf_chain", "rlhf_eval")
    }
    assert selections == {
        "sft_data": ["base_model", "chat_dataset", "rendered_tokens"],
        "sft_train": ["sft_checkpoint"],
        "sft_eval": ["sft_eval_report"],
        "sft_chain": ["base_model", "chat_dataset", "rendered_tokens", "sft_checkpoint"],
        "rl_data": ["base_model", "rl_problems"],
        "rl_train": ["rl_checkpoint", "rollout_batches"],
        "rl_eval": ["rl_eval_report"],
        "rl_chain": ["base_model", "rl_checkpoint", "rl_problems", "rollout_batches"],
        "preference_model_chain": ["base_model", "onpolicy_comparisons", "preference_model_checkpoint", "rl_problems"],
        "rlhf_train": ["rlhf_checkpoint", "rlhf_rollout_batches"],
        "rlhf_chain": ["base_model", "rl_problems", "rlhf_checkpoint", "rlhf_rollout_batches"],
        "rlhf_eval": ["rlhf_eval_report"],
    }


def test_recipe_jobs_run_in_process_by_default_and_multiprocess_on_request(project_state):
    """A process per step re-imports the code location for no parallelism (the steps form a chain)."""
    defs = build_definitions(tiny_resources(project_state))
    recipe_jobs = [job for job in defs.resolve_all_job_defs() if job.name.rsplit("_", 1)[-1] in ("data", "train", "chain")]
    assert len(recipe_jobs) >= 18
    for job in recipe_jobs:
        execution = job.run_config_schema.config_type.fields["execution"]
        assert execution.default_value == {"config": {"in_process": {}}}, job.name
    chain = defs.resolve_job_def("sft_chain")
    assert chain.run_config_schema.config_type.fields["execution"].config_type.fields["config"].config_type.fields.keys() >= {"in_process", "multiprocess"}


def test_every_config_field_has_a_default_and_a_description():
    from assets.base_model import BaseModelConfig
    from assets.benchmarks import BenchmarkConfig
    from assets.evals import EvalConfig

    configs = [BaseModelConfig, EvalConfig, BenchmarkConfig] + [training_config_class(spec) for spec in TRAINING_SPECS]
    for config in configs:
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


def test_launchpad_config_derives_from_the_library_config():
    """One field list: the SFT launchpad fields are SupervisedConfig's + TrainingConfig's (minus asset-owned) + init_from."""
    import dataclasses
    import typing

    from posttrain.supervised.config import SupervisedConfig
    from posttrain.training.config import TrainingConfig

    config = training_config_class(SFT)
    library = {f.name for f in dataclasses.fields(SupervisedConfig)} - {"training"}
    training = {f.name for f in dataclasses.fields(TrainingConfig)} - {"log_dir", "base_model", "init_from"}
    assert set(config.model_fields) == library | training | {"init_from"}
    assert typing.get_args(config.model_fields["lr_schedule"].annotation) == ("linear", "cosine", "constant")
    assert config.model_fields["learning_rate"].default == 5e-4  # SFT's asset default overrides the library's 1e-4
    assert set(config.model_fields["adam"].annotation.model_fields) == {"beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"}
