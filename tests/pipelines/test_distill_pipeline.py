"""Distillation on the tiny model, end to end: sft_chain (the teacher) → distill_chain with two teachers
routed by task → checkpoint partitions → distill_eval_report (teacher KL, accuracy, teacher accuracy,
parent column) → lineage reaches the teacher; prompt_distill_chain (teacher_responses → SFT) → its report."""

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow.parquet as pq
import pytest

from assets.checkpoint_manifest import all_manifests
from resources.state import STATE_DIR_ENV, ensure_dagster_home
from tests.fixtures.dagster_env import TINY_MODEL, tiny_resources
from tests.fixtures.lineage_audit import assert_manifest_names_exactly_the_tables_read

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(1800)  # the module fixture runs five Dagster jobs on CPU (minutes on a loaded machine)
SFT_CONFIG = {
    "ops": {
        "chat_dataset": {"config": {"limit": 16, "heldout_fraction": 0.25}},
        "sft_checkpoint": {"config": {"batch_size": 4, "max_steps": 1, "save_every": 0, "learning_rate": 1e-2, "lora_rank": 4}},
    }
}
PROBLEMS = {"limit": 24, "heldout_fraction": 0.25}  # reasoning_gym basic_arithmetic + chain_sum: two datasets
TEACHERS = {"basic_arithmetic": "latest:sft", "*": ""}  # the SFT checkpoint for one task, the base model for the other
DISTILL_CONFIG = {
    "ops": {
        "rl_problems": {"config": PROBLEMS},
        "distill_checkpoint": {"config": {"teachers": TEACHERS, "max_steps": 2, "save_every": 1, "group_size": 2,
                                          "groups_per_batch": 4, "max_tokens": 6, "learning_rate": 1e-3, "lora_rank": 4}},
    }
}
EVAL = {"max_problems": 3, "max_tokens": 6, "pass_k": 0}
PROMPT_CONFIG = {
    "ops": {
        "rl_problems": {"config": PROBLEMS},
        "teacher_responses": {"config": {"teacher": "latest:sft", "max_tokens": 6}},
        "prompt_distill_checkpoint": {"config": {"batch_size": 4, "max_steps": 2, "save_every": 0, "learning_rate": 1e-3, "lora_rank": 4}},
    }
}


@dataclass
class DistillRun:
    state: Path
    instance: dg.DagsterInstance
    defs: dg.Definitions
    distill: Any
    requested: list[str]
    evaluation: Any
    prompt: Any
    prompt_evaluation: Any
    env: dict[str, str]


@pytest.fixture(scope="module")
def distill_run(tmp_path_factory: pytest.TempPathFactory):
    from pipelines.definitions import build_definitions
    from resources.tinker import EMBEDDED_SERVERS

    state = tmp_path_factory.mktemp("distill_pipeline") / "state"
    env = {STATE_DIR_ENV: str(state), "DAGSTER_HOME": str(state / "dagster"), "POSTTRAIN_BASE_MODEL": TINY_MODEL}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        defs = build_definitions(tiny_resources(state))
        with dg.DagsterInstance.from_config(str(ensure_dagster_home())) as instance:
            assert defs.resolve_job_def("sft_chain").execute_in_process(instance=instance, run_config=SFT_CONFIG).success
            before = dg.evaluate_automation_conditions(defs=defs, instance=instance)
            distill = defs.resolve_job_def("distill_chain").execute_in_process(instance=instance, run_config=DISTILL_CONFIG)
            automation = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=before.cursor)
            requested = sorted(automation.get_requested_partitions(dg.AssetKey("distill_eval_report")))
            evaluation = defs.resolve_job_def("distill_eval").execute_in_process(
                instance=instance, partition_key=requested[-1], run_config={"ops": {"distill_eval_report": {"config": EVAL}}}
            )
            prompt = defs.resolve_job_def("prompt_distill_chain").execute_in_process(instance=instance, run_config=PROMPT_CONFIG)
            (prompt_manifest,) = [m for m in all_manifests() if m.recipe == "prompt_distill"]
            prompt_evaluation = defs.resolve_job_def("prompt_distill_eval").execute_in_process(
                instance=instance, partition_key=prompt_manifest.partition,
                run_config={"ops": {"prompt_distill_eval_report": {"config": EVAL}}},
            )
            try:
                yield DistillRun(state, instance, defs, distill, requested, evaluation, prompt, prompt_evaluation, env)
            finally:
                EMBEDDED_SERVERS.stop_all()


def _metadata(result, node):
    # the training node also records its checkpoint partitions' materializations: pick the node's own asset
    (materialization,) = [m for m in result.asset_materializations_for_node(node) if m.asset_key == dg.AssetKey(node)]
    return {key: getattr(value, "value", value) for key, value in materialization.metadata.items()}


def _manifests(recipe):
    return sorted((m for m in all_manifests() if m.recipe == recipe), key=lambda m: m.step)


def test_distill_chain_records_both_teachers_and_registers_each_checkpoint(distill_run):
    assert distill_run.distill.success
    (sft,) = _manifests("sft")
    manifests = _manifests("distill")
    assert [m.step for m in manifests] == [1, 2] and distill_run.requested == [m.partition for m in manifests]
    for manifest in manifests:
        assert manifest.init_from is None  # a fresh LoRA student: its start is the base model
        teachers = {entry["dataset"]: entry for entry in manifest.related["teachers"]}
        assert teachers["basic_arithmetic"]["partition"] == sft.partition and teachers["basic_arithmetic"]["sampler_path"] == sft.sampler_path
        assert teachers["*"]["partition"] is None and teachers["*"]["base_model"] == TINY_MODEL
    metadata = _metadata(distill_run.distill, "distill_checkpoint")
    assert metadata["total_steps"] == 2 and "final_teacher_kl" in metadata and "final_reward/mean" in metadata



def test_distill_rows_name_each_samples_dataset_and_teacher(distill_run):
    import json

    final = _manifests("distill")[-1]
    rows = [json.loads(line) for line in (Path(final.log_dir) / "distill_rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4 * 2  # steps x groups x samples, each once
    (sft,) = _manifests("sft")
    for row in rows:
        assert row["dataset"] in {"basic_arithmetic", "chain_sum"}
        assert row["teacher"] == (sft.partition if row["dataset"] == "basic_arithmetic" else TINY_MODEL)
        if row["dataset"] == "chain_sum" and row["step"] == 0:  # the student starts as the base model, its teacher here
            assert abs(row["teacher_kl"]) < 1e-3


def test_distill_eval_report_scores_teacher_kl_accuracy_and_the_teachers_accuracy(distill_run):
    assert distill_run.evaluation.success
    partition = distill_run.requested[-1]
    table = pq.read_table(distill_run.state / "parquet" / "distill_eval_report" / f"{partition}.parquet")
    rows = {row["metric"]: row for row in table.to_pylist()}
    assert {"teacher_kl", "accuracy", "teacher_accuracy"} <= set(rows)
    assert 0.0 <= rows["accuracy"]["checkpoint"] <= 1.0 and rows["teacher_kl"]["base"] is not None
    assert rows["teacher_accuracy"]["checkpoint"] == rows["teacher_accuracy"]["base"]  # one number: the teachers'
    assert "| teacher_kl |" in _metadata(distill_run.evaluation, "distill_eval_report")["report"]


def test_lineage_of_a_distilled_checkpoint_reaches_its_teacher(distill_run):
    final = _manifests("distill")[-1]
    (sft,) = _manifests("sft")
    result = subprocess.run([sys.executable, "-m", "pipelines", "lineage", final.partition], cwd=REPO,
                            env={**os.environ, **distill_run.env}, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert f"checkpoint      {final.partition}  (distill," in result.stdout
    assert f"{sft.partition} (sft, step 1" in result.stdout, result.stdout


def test_teacher_responses_leave_out_the_system_prompt_and_name_the_teacher(distill_run):
    assert distill_run.prompt.success
    (sft,) = _manifests("sft")
    metadata = _metadata(distill_run.prompt, "teacher_responses")
    assert metadata["teacher_partition"] == sft.partition and metadata["teacher_sampler_path"] == sft.sampler_path
    assert metadata["prompts_data_version"] and metadata["system_prompt"]
    table = pq.read_table(distill_run.state / "parquet" / "teacher_responses.parquet")
    rows = table.to_pylist()
    assert len(rows) == 24 and {row["split"] for row in rows} == {"train", "heldout"}
    assert all([m["role"] for m in row["messages"]] == ["user", "assistant"] for row in rows)
    (prompt_manifest,) = _manifests("prompt_distill")
    assert prompt_manifest.related["teachers"][0]["partition"] == sft.partition
    assert {"teacher_responses", "rl_problems"} <= set(prompt_manifest.upstream)


def test_prompt_distill_eval_report_has_agreement_and_accuracy(distill_run):
    assert distill_run.prompt_evaluation.success
    (manifest,) = _manifests("prompt_distill")
    table = pq.read_table(distill_run.state / "parquet" / "prompt_distill_eval_report" / f"{manifest.partition}.parquet")
    rows = {row["metric"]: row for row in table.to_pylist()}
    assert {"agreement", "accuracy"} <= set(rows)
    assert 0.0 <= rows["agreement"]["checkpoint"] <= 1.0 and rows["agreement"]["base"] is not None


def test_a_dataset_without_a_teacher_fails_before_training_naming_it(distill_run):
    with pytest.MonkeyPatch.context() as patch:
        for name, value in distill_run.env.items():
            patch.setenv(name, value)
        config = {"ops": {"distill_checkpoint": {"config": {"teachers": {"chain_sum": ""}, "max_steps": 1}}}}
        result = distill_run.defs.resolve_job_def("distill_train").execute_in_process(
            instance=distill_run.instance, run_config=config, raise_on_error=False
        )
    assert not result.success
    failure = next(event for event in result.all_events if event.event_type_value == "STEP_FAILURE")
    assert "no teacher for dataset 'basic_arithmetic'" in str(failure.step_failure_data.error.message)


def test_every_manifest_names_exactly_the_tables_it_read(distill_run):
    manifests = _manifests("distill") + _manifests("prompt_distill")
    assert {m.recipe for m in manifests} == {"distill", "prompt_distill"}
    for manifest in manifests:
        assert_manifest_names_exactly_the_tables_read(distill_run.defs, manifest)


@pytest.mark.slow
def test_both_distillations_draw_prompts_from_the_chat_table_and_are_judged_on_its_held_out_prompts(distill_run):
    """prompts=chat_dataset (the SFT conversations' user turns) for teacher_responses and for on-policy distillation:
    each manifest names the chat_dataset version read and not rl_problems; each report scores that version's held-out
    prompts (teacher agreement / teacher KL; no task accuracy: chat rows have no gold answers)."""
    chat = distill_run.instance.fetch_materializations(dg.AssetKey("chat_dataset"), limit=1).records[0]
    chat_version = chat.asset_materialization.tags["dagster/data_version"]
    heldout = [r for r in pq.read_table(distill_run.state / "parquet" / "chat_dataset.parquet").to_pylist() if r["split"] == "heldout"]
    training = {"max_steps": 1, "save_every": 0, "learning_rate": 1e-3, "lora_rank": 4}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in distill_run.env.items():
            patch.setenv(name, value)
        defs, instance = distill_run.defs, distill_run.instance
        responses = defs.resolve_job_def("prompt_distill_data").execute_in_process(
            instance=instance, asset_selection=[dg.AssetKey("teacher_responses")],
            run_config={"ops": {"teacher_responses": {"config": {"prompts": "chat_dataset", "teacher": "latest:sft", "max_tokens": 6}}}},
        )
        prompt = defs.resolve_job_def("prompt_distill_train").execute_in_process(
            instance=instance, run_config={"ops": {"prompt_distill_checkpoint": {"config": {**training, "batch_size": 4}}}})
        onpolicy = defs.resolve_job_def("distill_train").execute_in_process(instance=instance, run_config={"ops": {"distill_checkpoint": {
            "config": {**training, "prompts": "chat_dataset", "teachers": {"*": "latest:sft"}, "group_size": 2,
                       "groups_per_batch": 2, "max_tokens": 6}}}})
        manifests = [m for m in all_manifests() if m.training_dagster_run_id in (prompt.run_id, onpolicy.run_id)]
        reports = {m.recipe: defs.resolve_job_def(f"{m.recipe}_eval").execute_in_process(
            instance=instance, partition_key=m.partition, run_config={"ops": {f"{m.recipe}_eval_report": {"config": EVAL}}})
            for m in manifests}
    metadata = _metadata(responses, "teacher_responses")
    assert (metadata["prompts_asset"], metadata["prompts_data_version"]) == ("chat_dataset", chat_version)
    assert {m.recipe for m in manifests} == {"prompt_distill", "distill"}
    for manifest in manifests:
        assert manifest.upstream["chat_dataset"]["data_version"] == chat_version and "rl_problems" not in manifest.upstream
        assert_manifest_names_exactly_the_tables_read(defs, manifest)
        report = _metadata(reports[manifest.recipe], f"{manifest.recipe}_eval_report")
        assert report["data_versions"]["chat_dataset"] == chat_version
        path = distill_run.state / "parquet" / f"{manifest.recipe}_eval_report" / f"{manifest.partition}.parquet"
        rows = {row["metric"]: row for row in pq.read_table(path).to_pylist()}
        metric = "agreement" if manifest.recipe == "prompt_distill" else "teacher_kl"
        assert metric in rows and "accuracy" not in rows and rows[metric]["n"] == min(len(heldout), EVAL["max_problems"])
