"""The RL slice on the tiny model: sft_chain → rl_chain (init_from latest:sft) → checkpoint partitions →
rl_eval_report (pass@k, parent column) → rollout_batches traced to its sampler weights → lineage rl ← sft ← base."""

import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow.parquet as pq
import pytest
import tinker

from assets.checkpoint_manifest import all_manifests
from resources.state import STATE_DIR_ENV, ensure_dagster_home
from tests.fixtures.dagster_env import TINY_MODEL, tiny_resources
from tests.fixtures.lineage_audit import assert_manifest_names_exactly_the_tables_read

REPO = Path(__file__).resolve().parents[2]
SFT_CONFIG = {
    "ops": {
        "chat_dataset": {"config": {"limit": 24, "heldout_fraction": 0.25}},
        "sft_checkpoint": {"config": {"batch_size": 4, "max_steps": 2, "save_every": 0, "learning_rate": 1e-3, "lora_rank": 4}},
    }
}
RL_PROBLEMS_CONFIG = {"limit": 24, "heldout_fraction": 0.25}
RL_TRAINING_CONFIG = {"max_steps": 3, "save_every": 2, "group_size": 2, "groups_per_batch": 2, "max_tokens": 8, "learning_rate": 1e-3}
RL_CONFIG = {"ops": {"rl_problems": {"config": RL_PROBLEMS_CONFIG}, "rl_checkpoint": {"config": RL_TRAINING_CONFIG}}}
RL_EVAL_CONFIG = {"ops": {"rl_eval_report": {"config": {"max_problems": 3, "max_tokens": 8, "pass_k": 2}}}}


@dataclass
class RlPipelineRun:
    state: Path
    instance: dg.DagsterInstance
    defs: dg.Definitions
    sft: Any
    rl: Any
    requested: list[str]
    evaluation: Any
    env: dict[str, str]


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory: pytest.TempPathFactory):
    from pipelines.definitions import build_definitions
    from resources.tinker import EMBEDDED_SERVERS

    state = tmp_path_factory.mktemp("rl_pipeline") / "state"
    env = {STATE_DIR_ENV: str(state), "DAGSTER_HOME": str(state / "dagster"), "POSTTRAIN_BASE_MODEL": TINY_MODEL}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        defs = build_definitions(tiny_resources(state))
        with dg.DagsterInstance.from_config(str(ensure_dagster_home())) as instance:
            sft = defs.resolve_job_def("sft_chain").execute_in_process(instance=instance, run_config=SFT_CONFIG)
            before = dg.evaluate_automation_conditions(defs=defs, instance=instance)
            rl = defs.resolve_job_def("rl_chain").execute_in_process(instance=instance, run_config=RL_CONFIG)
            automation = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=before.cursor)
            requested = sorted(automation.get_requested_partitions(dg.AssetKey("rl_eval_report")))
            evaluation = defs.resolve_job_def("rl_eval").execute_in_process(
                instance=instance, partition_key=requested[-1], run_config=RL_EVAL_CONFIG
            )
            try:
                yield RlPipelineRun(state, instance, defs, sft, rl, requested, evaluation, env)
            finally:
                EMBEDDED_SERVERS.stop_all()


def _metadata(result, node):
    (materialization,) = [m for m in result.asset_materializations_for_node(node) if m.asset_key == dg.AssetKey(node)]
    return {key: getattr(value, "value", value) for key, value in materialization.metadata.items()}


def _rl_manifests(run):
    return sorted((m for m in all_manifests() if m.recipe == "rl"), key=lambda m: m.step)


def test_rl_chain_starts_from_the_latest_sft_checkpoint_and_registers_each_checkpoint(rl_run):
    assert rl_run.sft.success and rl_run.rl.success
    (sft_manifest,) = [m for m in all_manifests() if m.recipe == "sft"]
    manifests = _rl_manifests(rl_run)
    assert [m.step for m in manifests] == [2, 3]
    assert sorted(rl_run.instance.get_dynamic_partitions("rl_checkpoints")) == sorted(m.partition for m in manifests)
    assert rl_run.requested == sorted(m.partition for m in manifests)  # automation evaluates every new checkpoint
    for manifest in manifests:
        assert manifest.parent_partition == sft_manifest.partition and manifest.init_from == sft_manifest.state_path
        assert manifest.renderer == "chatml" and manifest.related["env"]["name"] == "problems"
        assert "rl_problems" in manifest.upstream and manifest.upstream["rl_problems"]["metadata"]["source"].startswith("reasoning_gym:")
    metadata = _metadata(rl_run.rl, "rl_checkpoint")
    assert metadata["total_steps"] == 3 and metadata["init_from"].startswith(sft_manifest.partition)
    for name in ("final_reward/mean", "final_accuracy", "final_loss", "final_entropy", "final_tokens_per_second",
                 "final_frac_constant_reward_groups", "final_kl_sample_train_k1"):
        assert name in metadata, f"{name} missing from {sorted(metadata)}"


def test_every_rl_metric_reaches_mlflow_once_per_step(rl_run):
    from resources.mlflow import MlflowResource

    with pytest.MonkeyPatch.context() as patch:
        for name, value in rl_run.env.items():
            patch.setenv(name, value)
        client = MlflowResource().get_client()
        run_id = _rl_manifests(rl_run)[-1].mlflow_run_id
        for metric in ("reward/mean", "reward/std", "accuracy", "loss", "entropy", "kl_sample_train_k1", "tokens_per_second",
                       "sampling/tokens_per_s", "frac_constant_reward_groups", "learning_rate"):
            assert [m.step for m in client.get_metric_history(run_id, metric)] == [0, 1, 2], metric
        logged = client.get_run(run_id).data.metrics
        assert not [name for name in logged if name.startswith(("staleness/", "async/"))], "a sync run logs no off-policy counters"
        artifacts = [a.path for a in client.list_artifacts(run_id, "rollouts")]
        assert any(path.endswith(".png") for path in artifacts)


def test_eval_report_has_the_env_reward_greedy_accuracy_pass_at_k_and_a_paired_parent_column(rl_run):
    result = rl_run.evaluation
    assert result.success
    partition = rl_run.requested[-1]
    table = pq.read_table(rl_run.state / "parquet" / "rl_eval_report" / f"{partition}.parquet")
    rows = {row["metric"]: row for row in table.to_pylist()}
    assert set(rows) == {"reward", "accuracy", "pass@1", "pass@2"}
    for metric in ("accuracy", "pass@1", "pass@2"):
        row = rows[metric]
        assert 0.0 <= row["checkpoint"] <= 1.0 and row["base"] is not None and row["parent"] is not None
        assert row["n"] == 3 and row["delta_parent_stderr"] is not None  # max_problems held-out rows, paired
    assert -0.1 - 1e-9 <= rows["reward"]["checkpoint"] <= 1.0  # the env's own reward: format_coef·(format − 1) + score
    assert rows["pass@2"]["checkpoint"] >= rows["pass@1"]["checkpoint"]  # more tries never find less
    metadata = _metadata(result, "rl_eval_report")
    assert metadata["checkpoint"] == partition and "| pass@2 |" in metadata["report"] and "Δ vs parent" in metadata["report"]


def test_rollout_batches_are_every_sample_once_and_trace_to_sampler_weights(rl_run):
    table = pq.read_table(rl_run.state / "parquet" / "rollout_batches.parquet")
    rows = table.to_pylist()
    assert Counter(row["step"] for row in rows) == {0: 4, 1: 4, 2: 4}  # groups_per_batch × group_size per step
    assert len({(row["step"], row["group"], row["sample"]) for row in rows}) == len(rows)
    final = _rl_manifests(rl_run)[-1]
    for row in rows:
        assert len(row["completion_tokens"]) == len(row["sampler_logprobs"]) > 0
        assert row["training_run_id"] == Path(final.log_dir).name and row["mlflow_run_id"] == final.mlflow_run_id
        assert row["sampler_path"].startswith("tinker://") and f"rl-step{row['step']:06d}" in row["sampler_path"]
    for step in range(3):
        members = [row for row in rows if row["step"] == step]
        for group in {row["group"] for row in members}:
            rewards = [row["reward"] for row in members if row["group"] == group]
            advantages = [row["advantage"] for row in members if row["group"] == group]
            assert advantages == pytest.approx([r - sum(rewards) / len(rewards) for r in rewards], abs=1e-9)
    metadata = _metadata(rl_run.rl, "rollout_batches")
    curve = Path(metadata["reward_curve_path"])
    assert metadata["dagster/row_count"] == 12 and curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"/mlflow/get-artifact?path=rollouts%2F{curve.name}&run_uuid={_rl_manifests(rl_run)[-1].mlflow_run_id}" in metadata["reward_curve"]
    assert len(metadata["reward_per_step"].records) == 3

    with pytest.MonkeyPatch.context() as patch:
        for name, value in rl_run.env.items():
            patch.setenv(name, value)
        with tiny_resources(rl_run.state)["tinker"].session("trace a rollout") as service:
            for row in (rows[0], rows[-1]):  # a sample of the first step and of the last
                sampler = service.create_sampling_client(model_path=row["sampler_path"]).result()
                sequence = tinker.ModelInput.from_ints(row["prompt_tokens"] + row["completion_tokens"])
                logprobs = sampler.compute_logprobs(sequence).result()[len(row["prompt_tokens"]):]
                assert logprobs == pytest.approx(row["sampler_logprobs"], abs=1e-3)  # these weights sampled it


def test_lineage_prints_rl_then_sft_then_base(rl_run):
    final = _rl_manifests(rl_run)[-1]
    env = {**os.environ, **rl_run.env}
    result = subprocess.run([sys.executable, "-m", "pipelines", "lineage", final.state_path], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    rl_at = out.find(f"checkpoint      {final.partition}  (rl,")
    sft_at = out.find(f"checkpoint      {final.parent_partition}  (sft,", rl_at)
    base_at = out.find("base model      localtinker/tiny-random", sft_at)
    assert 0 <= rl_at < sft_at < base_at, out


def test_a_report_scores_the_version_trained_on_even_after_the_table_is_rematerialized_with_other_rows(rl_run):
    partition = rl_run.requested[-1]
    manifest = next(m for m in _rl_manifests(rl_run) if m.partition == partition)
    trained = manifest.upstream["rl_problems"]["data_version"]
    path = rl_run.state / "parquet" / "rl_eval_report" / f"{partition}.parquet"
    before = {row["metric"]: row for row in pq.read_table(path).to_pylist()}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in rl_run.env.items():
            patch.setenv(name, value)
        other = {"ops": {"rl_problems": {"config": {"source": "arithmetic?count=40", "heldout_fraction": 0.5}}}}
        redo = rl_run.defs.resolve_job_def("rl_data").execute_in_process(instance=rl_run.instance, run_config=other)
        again = rl_run.defs.resolve_job_def("rl_eval").execute_in_process(
            instance=rl_run.instance, partition_key=partition, run_config=RL_EVAL_CONFIG
        )
    latest = redo.asset_materializations_for_node("rl_problems")[0].tags["dagster/data_version"]
    assert latest != trained and again.success
    assert _metadata(again, "rl_eval_report")["data_versions"] == {"rl_problems": trained}
    after = {row["metric"]: row for row in pq.read_table(path).to_pylist()}
    assert {m: (r["n"], r["checkpoint"], r["base"]) for m, r in after.items()} == {
        m: (r["n"], r["checkpoint"], r["base"]) for m, r in before.items()}  # the same held-out rows, not the new table's


def test_every_manifest_names_exactly_the_tables_it_read(rl_run):
    for manifest in _rl_manifests(rl_run):
        assert_manifest_names_exactly_the_tables_read(rl_run.defs, manifest)


GSM8K_ROWS = [  # the real GSM8K schema: a worked solution ending in '#### <answer>'
    {"question": f"Tom has {i} apples and buys {i + 3} more. How many apples does he have?",
     "answer": f"Tom has {i} + {i + 3} = <<{i}+{i + 3}={2 * i + 3}>>{2 * i + 3} apples.\n#### {2 * i + 3}"}
    for i in range(1, 33)
]


@pytest.mark.slow
def test_rl_on_a_gsm8k_format_table_is_judged_on_its_held_out_rows_and_its_lineage_json_names_it(rl_run, tmp_path):
    """rl_problems from a local copy of GSM8K (source gsm8k + path: the preset's mapping on the real schema) → rl_chain
    → the eval report scores the held-out rows of exactly that version; `lineage --json` names it and the report."""
    import json

    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in GSM8K_ROWS))
    problems = {"source": "gsm8k", "path": str(path), "heldout_fraction": 0.25}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in rl_run.env.items():
            patch.setenv(name, value)
        chain = rl_run.defs.resolve_job_def("rl_chain").execute_in_process(instance=rl_run.instance, run_config={
            "ops": {"rl_problems": {"config": problems}, "rl_checkpoint": {"config": {**RL_TRAINING_CONFIG, "max_steps": 1, "save_every": 0}}}})
        (final,) = [m for m in all_manifests() if m.training_dagster_run_id == chain.run_id]
        evaluation = rl_run.defs.resolve_job_def("rl_eval").execute_in_process(
            instance=rl_run.instance, partition_key=final.partition, run_config=RL_EVAL_CONFIG)
        lineage = subprocess.run([sys.executable, "-m", "pipelines", "lineage", final.partition, "--json"], cwd=REPO,
                                 env={**os.environ, **rl_run.env}, capture_output=True, text=True, timeout=180)
    trained = final.upstream["rl_problems"]
    assert trained["metadata"]["source"] == "gsm8k"
    assert trained["data_version"] == chain.asset_materializations_for_node("rl_problems")[0].tags["dagster/data_version"]
    heldout = [r for r in pq.read_table(trained["metadata"]["parquet/version_path"]).to_pylist() if r["split"] == "heldout"]
    assert heldout and all(r["question"].startswith("Tom has") for r in heldout)
    assert _metadata(evaluation, "rl_eval_report")["data_versions"] == {"rl_problems": trained["data_version"]}
    rows = {row["metric"]: row for row in pq.read_table(rl_run.state / "parquet" / "rl_eval_report" / f"{final.partition}.parquet").to_pylist()}
    assert rows["accuracy"]["n"] == min(len(heldout), RL_EVAL_CONFIG["ops"]["rl_eval_report"]["config"]["max_problems"])
    assert_manifest_names_exactly_the_tables_read(rl_run.defs, final)
    assert lineage.returncode == 0, lineage.stderr
    hop = json.loads(lineage.stdout)["hops"][0]
    datasets = {entry["asset"]: entry for entry in hop["datasets"]}
    assert set(datasets) == {"rl_problems"} and datasets["rl_problems"]["source"] == "gsm8k"
    assert datasets["rl_problems"]["data_version"] == trained["data_version"]
    assert datasets["rl_problems"]["rows"] == len(GSM8K_ROWS)
    (report,) = [r for r in hop["eval_reports"] if r["run_id"] == evaluation.run_id]
    assert report["data_versions"] == {"rl_problems": trained["data_version"]}
