"""The code RL slice on the tiny model: code_rl_chain → checkpoint partitions → rollouts with sandbox status →
code_rl_eval_report (pass@1/pass@k on the held-out tasks of the code_problems version trained on, and on
nothing else, against the base model)."""

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow.parquet as pq
import pytest

from assets.checkpoint_manifest import all_manifests
from posttrain.training.rows import JsonlRowSink
from resources.state import STATE_DIR_ENV, ensure_dagster_home
from tests.fixtures.dagster_env import TINY_MODEL, tiny_resources
from tests.fixtures.lineage_audit import assert_manifest_names_exactly_the_tables_read

CODE_PROBLEMS_CONFIG = {"source": "code_tasks:easy?count=24", "heldout_fraction": 0.25}
TRAINING_CONFIG = {"max_steps": 2, "save_every": 1, "group_size": 2, "groups_per_batch": 2, "max_tokens": 8,
                   "learning_rate": 1e-3, "lora_rank": 4}
CHAIN_CONFIG = {"ops": {"code_problems": {"config": CODE_PROBLEMS_CONFIG}, "code_rl_checkpoint": {"config": TRAINING_CONFIG}}}
EVAL_CONFIG = {"ops": {"code_rl_eval_report": {"config": {"max_problems": 2, "max_tokens": 8, "pass_k": 2}}}}
STATUSES = {"passed", "failed", "timeout", "crashed", "sandbox_error", "no_code_block"}


@dataclass
class CodeRlRun:
    state: Path
    instance: dg.DagsterInstance
    defs: dg.Definitions
    chain: Any
    requested: list[str]
    evaluation: Any


@pytest.fixture(scope="module")
def code_rl_run(tmp_path_factory: pytest.TempPathFactory):
    from pipelines.definitions import build_definitions
    from resources.tinker import EMBEDDED_SERVERS

    state = tmp_path_factory.mktemp("code_rl_pipeline") / "state"
    env = {STATE_DIR_ENV: str(state), "DAGSTER_HOME": str(state / "dagster"), "POSTTRAIN_BASE_MODEL": TINY_MODEL}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        defs = build_definitions(tiny_resources(state))
        with dg.DagsterInstance.from_config(str(ensure_dagster_home())) as instance:
            before = dg.evaluate_automation_conditions(defs=defs, instance=instance)
            chain = defs.resolve_job_def("code_rl_chain").execute_in_process(instance=instance, run_config=CHAIN_CONFIG)
            automation = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=before.cursor)
            requested = sorted(automation.get_requested_partitions(dg.AssetKey("code_rl_eval_report")))
            evaluation = defs.resolve_job_def("code_rl_eval").execute_in_process(
                instance=instance, partition_key=requested[-1], run_config=EVAL_CONFIG
            )
            try:
                yield CodeRlRun(state, instance, defs, chain, requested, evaluation)
            finally:
                EMBEDDED_SERVERS.stop_all()


def _metadata(result, node):
    (materialization,) = [m for m in result.asset_materializations_for_node(node) if m.asset_key == dg.AssetKey(node)]
    return {key: getattr(value, "value", value) for key, value in materialization.metadata.items()}


def _manifests():
    return sorted((m for m in all_manifests() if m.recipe == "code_rl"), key=lambda m: m.step)


def test_chain_trains_from_the_base_model_and_registers_each_checkpoint(code_rl_run):
    assert code_rl_run.chain.success
    manifests = _manifests()
    assert [m.step for m in manifests] == [1, 2]
    assert sorted(code_rl_run.instance.get_dynamic_partitions("code_rl_checkpoints")) == [m.partition for m in manifests]
    assert code_rl_run.requested == [m.partition for m in manifests]  # automation evaluates every new checkpoint
    for manifest in manifests:
        assert manifest.init_from is None and manifest.parent_partition is None  # default: the base model
        assert manifest.related["env"]["name"] == "code" and "code_problems" in manifest.upstream
    metadata = _metadata(code_rl_run.chain, "code_rl_checkpoint")
    assert metadata["total_steps"] == 2 and metadata["init_from"] == "base model"
    for name in ("final_reward/mean", "final_accuracy", "final_env/has_code_block", "final_env/status/no_code_block"):
        assert name in metadata, f"{name} missing from {sorted(metadata)}"


def test_every_sample_is_a_rollout_row_with_its_sandbox_status_and_reward(code_rl_run):
    rows = JsonlRowSink(Path(_manifests()[-1].log_dir) / "rollouts.jsonl").read()
    assert Counter(row["step"] for row in rows) == {0: 4, 1: 4}  # groups_per_batch × group_size per step
    table = pq.read_table(code_rl_run.state / "parquet" / "code_problems.parquet").to_pylist()
    train_prompts = {row["prompt"] for row in table if row["split"] == "train"}
    for row in rows:
        assert row["sandbox_status"] in STATUSES and isinstance(row["test_output"], str)
        assert row["reward"] == pytest.approx({"passed": 1.0, "no_code_block": -0.1}.get(row["sandbox_status"], 0.0))
        assert row["correct"] == float(row["sandbox_status"] == "passed")
        assert any(prompt in row["prompt"] for prompt in train_prompts)  # never a held-out problem


def test_eval_report_scores_the_held_out_tasks_of_the_trained_version_only(code_rl_run):
    result = code_rl_run.evaluation
    assert result.success
    partition = code_rl_run.requested[-1]
    table = pq.read_table(code_rl_run.state / "parquet" / "code_rl_eval_report" / f"{partition}.parquet")
    rows = {row["metric"]: row for row in table.to_pylist()}
    scored = ("accuracy", "pass@1", "pass@2", "format_rate")
    assert set(scored) <= set(rows) and not any("/" in metric for metric in rows)  # no side-loaded suite (HumanEval)
    for metric in scored:
        assert 0.0 <= rows[metric]["checkpoint"] <= 1.0 and rows[metric]["base"] is not None and rows[metric]["parent"] is None
        assert rows[metric]["vs_base"] in {"better", "worse", "equal", "within noise"}  # suite-prefixed names are scored too
        assert rows[metric]["n"] == 2  # per held-out problem (max_problems)
    metadata = _metadata(result, "code_rl_eval_report")
    manifest = next(m for m in _manifests() if m.partition == partition)
    assert metadata["checkpoint"] == partition and "| pass@1 |" in metadata["report"]
    assert metadata["data_versions"] == {"code_problems": manifest.upstream["code_problems"]["data_version"]}


def test_code_eval_defaults_to_a_code_sized_answer_budget():
    from assets.code_rl import CODE_RL_EVAL, EVAL_MAX_TOKENS
    from assets.evals import EvalConfig, eval_config_class

    config = eval_config_class(CODE_RL_EVAL)
    assert issubclass(config, EvalConfig) and config().max_tokens == EVAL_MAX_TOKENS > EvalConfig().max_tokens
    assert config.model_fields["max_tokens"].description == EvalConfig.model_fields["max_tokens"].description


def test_an_env_other_than_code_is_refused_naming_the_fix(code_rl_run):
    result = code_rl_run.defs.resolve_job_def("code_rl_train").execute_in_process(
        instance=code_rl_run.instance,
        run_config={"ops": {"code_rl_checkpoint": {"config": {**TRAINING_CONFIG, "env": "arithmetic"}}}},
        raise_on_error=False,
    )
    assert not result.success
    (failure,) = [event for event in result.all_events if event.is_step_failure]
    message = failure.step_failure_data.error.message
    assert "env must be 'code'" in message and "rl_checkpoint" in message


def test_every_manifest_names_exactly_the_tables_it_read(code_rl_run):
    for manifest in _manifests():
        assert_manifest_names_exactly_the_tables_read(code_rl_run.defs, manifest)
