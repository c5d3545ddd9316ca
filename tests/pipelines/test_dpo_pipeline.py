"""DPO on the tiny model, end to end: sft_chain → dpo_chain (on-policy comparisons sampled from the SFT
checkpoint → pairs → reference logprobs → DPO) → checkpoint partitions → dpo_eval_report (pair accuracy,
accuracy, win rate, parent column) → lineage reaches the pairs' sampler; a β sweep scores the reference
once; bad pairs fail with a clear message and store nothing.

A random tiny model never answers an arithmetic problem correctly, so no prompt would give a pair: the
verifier of the sampled answers is replaced by a judge that alternates correct / incorrect, so every
prompt's group is mixed. Sampling, pairing, rendering, reference scoring, training and evaluation
(with the real verifier) are all real.
"""

import itertools
import json
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
from assets.preferences import preference_comparisons
from posttrain.preference.recipe import REFERENCE_FILE
from resources.state import STATE_DIR_ENV, ensure_dagster_home
from tests.fixtures.dagster_env import TINY_MODEL, tiny_resources
from tests.fixtures.lineage_audit import assert_manifest_names_exactly_the_tables_read

REPO = Path(__file__).resolve().parents[2]
SFT_CONFIG = {
    "ops": {
        "chat_dataset": {"config": {"limit": 16, "heldout_fraction": 0.25}},
        "sft_checkpoint": {"config": {"batch_size": 4, "max_steps": 1, "save_every": 0, "learning_rate": 1e-2, "lora_rank": 4}},
    }
}
DPO_TRAINING = {"batch_size": 4, "max_steps": 2, "save_every": 1, "learning_rate": 1e-3}
DPO_CONFIG = {
    "ops": {
        "rl_problems": {"config": {"limit": 16, "heldout_fraction": 0.25}},
        "onpolicy_comparisons": {"config": {"group_size": 4, "max_tokens": 6}},
        "dpo_checkpoint": {"config": {**DPO_TRAINING, "beta": 0.1}},
    }
}
SWEEP_BETA = 0.5
EVAL = {"max_problems": 3, "max_tokens": 6, "max_heldout_sequences": 4}


class AlternatingJudge:
    """Grades answers 1, 0, 1, 0 ... in the order they are graded (a group of 4 is always mixed)."""

    def __init__(self) -> None:
        self.verdicts = itertools.cycle([1.0, 0.0])

    def __call__(self, extracted, problem) -> float:
        return next(self.verdicts)


@dataclass
class DpoRun:
    state: Path
    instance: dg.DagsterInstance
    defs: dg.Definitions
    chain: Any
    sweep: Any
    requested: list[str]
    evaluation: Any
    reference_scorings: list[int]  # pairs scored per compute_reference_logprobs call, anywhere
    env: dict[str, str]


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory: pytest.TempPathFactory):
    import assets.dpo
    import posttrain.preference.recipe
    from pipelines.definitions import build_definitions
    from posttrain.preference.reference import compute_reference_logprobs
    from resources.tinker import EMBEDDED_SERVERS

    scorings: list[int] = []

    def counted(client, pairs):
        scorings.append(len(pairs))
        return compute_reference_logprobs(client, pairs)

    state = tmp_path_factory.mktemp("dpo_pipeline") / "state"
    env = {STATE_DIR_ENV: str(state), "DAGSTER_HOME": str(state / "dagster"), "POSTTRAIN_BASE_MODEL": TINY_MODEL}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        patch.setattr(assets.dpo, "grade_answer", AlternatingJudge())
        patch.setattr(assets.dpo, "compute_reference_logprobs", counted)
        patch.setattr(posttrain.preference.recipe, "compute_reference_logprobs", counted)
        defs = build_definitions(tiny_resources(state))
        with dg.DagsterInstance.from_config(str(ensure_dagster_home())) as instance:
            assert defs.resolve_job_def("sft_chain").execute_in_process(instance=instance, run_config=SFT_CONFIG).success
            before = dg.evaluate_automation_conditions(defs=defs, instance=instance)
            chain = defs.resolve_job_def("dpo_chain").execute_in_process(instance=instance, run_config=DPO_CONFIG)
            automation = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=before.cursor)
            requested = sorted(automation.get_requested_partitions(dg.AssetKey("dpo_eval_report")))
            sweep = defs.resolve_job_def("dpo_train").execute_in_process(
                instance=instance, run_config={"ops": {"dpo_checkpoint": {"config": {**DPO_TRAINING, "beta": SWEEP_BETA}}}}
            )
            evaluation = defs.resolve_job_def("dpo_eval").execute_in_process(
                instance=instance, partition_key=requested[-1], run_config={"ops": {"dpo_eval_report": {"config": EVAL}}}
            )
            try:
                yield DpoRun(state, instance, defs, chain, sweep, requested, evaluation, scorings, env)
            finally:
                EMBEDDED_SERVERS.stop_all()


def _metadata(result, node):
    (materialization,) = [m for m in result.asset_materializations_for_node(node) if m.asset_key == dg.AssetKey(node)]
    return {key: getattr(value, "value", value) for key, value in materialization.metadata.items()}


def _data_version(result, node):
    (materialization,) = [m for m in result.asset_materializations_for_node(node) if m.asset_key == dg.AssetKey(node)]
    return materialization.tags["dagster/data_version"]


def _manifests(recipe, run_id=None):
    return sorted((m for m in all_manifests() if m.recipe == recipe and run_id in (None, m.training_dagster_run_id)), key=lambda m: m.step)


def test_onpolicy_comparisons_name_their_sampler_and_keep_the_problems_split(dpo_run):
    assert dpo_run.chain.success
    (sft,) = _manifests("sft")
    metadata = _metadata(dpo_run.chain, "onpolicy_comparisons")
    assert metadata["sampler_partition"] == sft.partition and metadata["sampler_path"] == sft.sampler_path
    assert metadata["prompts_used"] == 16 and metadata["dagster/row_count"] == 16  # every group mixed: one pair per prompt
    assert metadata["dropped_all_correct"] == 0 and metadata["dropped_none_correct"] == 0 and metadata["sample_accuracy"] == 0.5
    assert "16 pairs from 16 prompts" in metadata["preview"]
    comparisons = pq.read_table(dpo_run.state / "parquet" / "onpolicy_comparisons.parquet").to_pylist()
    problems = {row["row_id"]: row for row in pq.read_table(dpo_run.state / "parquet" / "rl_problems.parquet").to_pylist()}
    assert comparisons and {row["split"] for row in comparisons} == {"train", "heldout"}
    for row in comparisons:
        assert row["split"] == problems[row["row_id"]]["split"]
        assert row["source"] == "onpolicy:" + sft.sampler_path
        assert row["prompt"][-1]["content"] == problems[row["row_id"]]["question"]
        assert row["chosen"][0]["content"] != row["rejected"][0]["content"]
    pairs = _metadata(dpo_run.chain, "onpolicy_pairs")
    assert pairs["dagster/row_count"] == len(comparisons) and pairs["renderer"] == "chatml"
    assert {c.check_name for c in dpo_run.chain.get_asset_check_evaluations() if c.passed} >= {
        "has_pairs", "pairs_differ", "pairs_differ_and_share_prompt", "finite"}


def test_dpo_chain_registers_each_checkpoint_with_its_reference_and_pair_sampler(dpo_run):
    (sft,) = _manifests("sft")
    manifests = _manifests("dpo", dpo_run.chain.run_id)
    assert [m.step for m in manifests] == [1, 2] and dpo_run.requested == [m.partition for m in manifests]
    reference_version = _data_version(dpo_run.chain, "reference_logprobs")
    for manifest in manifests:
        assert manifest.parent_partition == sft.partition and manifest.init_from == sft.state_path
        assert manifest.related["pair_sampler"]["partition"] == sft.partition
        assert manifest.related["reference"]["partition"] == sft.partition
        assert manifest.related["reference"]["sampler_path"] == sft.sampler_path
        assert manifest.related["reference"]["logprobs"]["data_version"] == reference_version
        assert manifest.related["pairs"]["asset"] == "onpolicy_pairs" and manifest.related["dpo"] == {"beta": 0.1}
        assert {"onpolicy_pairs", "onpolicy_comparisons", "rl_problems"} <= set(manifest.upstream)
        assert manifest.upstream["reference_logprobs"]["data_version"] == reference_version  # read, so recorded
    metadata = _metadata(dpo_run.chain, "dpo_checkpoint")
    assert metadata["total_steps"] == 2 and 0 < metadata["final_dpo_loss"] < 5 and "final_eval/pair_accuracy" in metadata


def test_a_beta_sweep_scores_the_reference_once(dpo_run):
    assert dpo_run.sweep.success
    reference = _metadata(dpo_run.chain, "reference_logprobs")
    assert reference["cached"] is False and reference["reference_partition"] == _manifests("sft")[0].partition
    assert dpo_run.reference_scorings == [reference["dagster/row_count"]]  # the asset, once: not the DPO runs, not the eval
    for run in (dpo_run.chain, dpo_run.sweep):
        final = _manifests("dpo", run.run_id)[-1]
        assert not (Path(final.log_dir) / REFERENCE_FILE).exists()  # the recipe computed no reference of its own
        assert final.related["reference"]["logprobs"]["data_version"] == _data_version(dpo_run.chain, "reference_logprobs")
    assert _manifests("dpo", dpo_run.sweep.run_id)[-1].related["dpo"] == {"beta": SWEEP_BETA}


def test_reference_logprobs_rematerialized_with_the_same_inputs_are_cached(dpo_run):
    before = list(dpo_run.reference_scorings)
    job = dpo_run.defs.resolve_job_def("dpo_data")
    result = job.execute_in_process(instance=dpo_run.instance, asset_selection=[dg.AssetKey("reference_logprobs")])
    metadata = _metadata(result, "reference_logprobs")
    first = _metadata(dpo_run.chain, "reference_logprobs")
    assert metadata["cached"] is True and dpo_run.reference_scorings == before
    assert metadata["pairs_data_version"] == first["pairs_data_version"]
    versions = [r.asset_materialization.tags["dagster/data_version"]
                for r in dpo_run.instance.fetch_materializations(dg.AssetKey("reference_logprobs"), limit=2).records]
    assert versions[0] == versions[1]


def _report_rows(state, partition):
    return {row["metric"]: row for row in pq.read_table(state / "parquet" / "dpo_eval_report" / f"{partition}.parquet").to_pylist()}


def test_dpo_eval_report_scores_the_held_out_pairs_it_trained_on_under_the_implicit_reward(dpo_run):
    assert dpo_run.evaluation.success
    partition = dpo_run.requested[-1]
    rows = _report_rows(dpo_run.state, partition)
    assert set(rows) == {"pair_accuracy", "margin", "dpo_loss"}  # about the pairs, not about another task
    heldout = [r for r in pq.read_table(dpo_run.state / "parquet" / "onpolicy_pairs.parquet").to_pylist() if r["split"] == "heldout"]
    for row in rows.values():
        assert row["n"] == min(len(heldout), EVAL["max_heldout_sequences"]) and row["parent"] is not None and row["base"] is not None
    assert 0.0 <= rows["pair_accuracy"]["checkpoint"] <= 1.0
    # The parent is the reference: its margins are 0 up to sampler/trainer float noise (~1e-6), so its pair
    # accuracy is a coin toss on that noise and only its margin is meaningful.
    assert abs(rows["margin"]["parent"]) < 1e-3
    metadata = _metadata(dpo_run.evaluation, "dpo_eval_report")
    assert "| pair_accuracy |" in metadata["report"] and metadata["score_metric"] == "pair_accuracy"
    assert set(metadata["data_versions"]) == {"onpolicy_pairs"}


def test_lineage_of_a_dpo_checkpoint_reaches_the_pairs_sampler_and_the_base_model(dpo_run):
    final = _manifests("dpo", dpo_run.chain.run_id)[-1]
    (sft,) = _manifests("sft")
    result = subprocess.run([sys.executable, "-m", "pipelines", "lineage", final.partition], cwd=REPO,
                            env={**os.environ, **dpo_run.env}, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"checkpoint      {final.partition}  (dpo," in out
    assert f"pair_sampler  {sft.partition} (sft, step 1" in out and f"reference     {sft.partition} (sft" in out
    assert "data          onpolicy_pairs @" in out and "data          rendered_tokens @" in out
    assert f"base model      {TINY_MODEL}" in out


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"prompt": "Hi", "chosen": "Same", "rejected": "Same"}, "chosen and rejected completions are identical"),
        (
            {"chosen": [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "x"}],
             "rejected": [{"role": "user", "content": "B?"}, {"role": "assistant", "content": "y"}]},
            "do not share the same prompt turns",
        ),
        (None, "no usable comparison rows"),
    ],
    ids=["identical", "different_prompts", "empty"],
)
def test_bad_pairs_fail_with_a_clear_message_and_store_nothing(dpo_run, tmp_path, line, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text("" if line is None else json.dumps(line) + "\n")
    before = dpo_run.instance.get_dynamic_partitions("dpo_checkpoints")
    columns = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
    result = dg.materialize(
        [preference_comparisons], instance=dpo_run.instance, resources=tiny_resources(dpo_run.state), raise_on_error=False,
        run_config={"ops": {"preference_comparisons": {"config": {"source": str(path), "columns": columns}}}},
    )
    assert not result.success
    description = result.failure_data_for_node("preference_comparisons").user_failure_data.description
    assert description.startswith("preference_comparisons: ") and message in description
    assert not (dpo_run.state / "parquet" / "preference_comparisons.parquet").exists()
    training = dpo_run.defs.resolve_job_def("dpo_train").execute_in_process(
        instance=dpo_run.instance, raise_on_error=False,
        run_config={"ops": {"dpo_checkpoint": {"config": {**DPO_TRAINING, "pairs": "preference_pairs"}}}},
    )
    assert not training.success
    assert "'preference_pairs' has never been materialized" in training.failure_data_for_node("dpo_checkpoint").user_failure_data.description
    assert dpo_run.instance.get_dynamic_partitions("dpo_checkpoints") == before


HH_RLHF_ROWS = [  # the real HH-RLHF schema: two whole transcripts that share their prompt
    {"chosen": f"\n\nHuman: What is {i} + 1?\n\nAssistant: It is {i + 1}.", "rejected": f"\n\nHuman: What is {i} + 1?\n\nAssistant: It is {i + 7}."}
    for i in range(24)
]


def test_dpo_on_offline_pairs_trains_and_is_evaluated_on_those_pairs(dpo_run, tmp_path):
    """`dpo_offline_chain`: HH-RLHF-shaped comparisons → pairs → reference (base) → DPO from the base model;
    its eval scores the held-out pairs of that pairs version, and its lineage names the comparisons."""
    path = tmp_path / "hh_rlhf.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in HH_RLHF_ROWS))
    config = {"ops": {
        "preference_comparisons": {"config": {"source": "hh_rlhf", "path": str(path), "heldout_fraction": 0.4}},
        "reference_logprobs": {"config": {"reference": ""}},  # pairs left at onpolicy_pairs: refused, not read stale
        "dpo_checkpoint": {"config": {**DPO_TRAINING, "beta": 0.1, "init_from": ""}},
    }}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in dpo_run.env.items():
            patch.setenv(name, value)
        job = dpo_run.defs.resolve_job_def("dpo_offline_chain")
        refused = job.execute_in_process(instance=dpo_run.instance, run_config=config, raise_on_error=False)
        failure = refused.failure_data_for_node("reference_logprobs").user_failure_data.description
        assert "materializes preference_pairs, but pairs='onpolicy_pairs' would read an older onpolicy_pairs" in failure
        config["ops"]["reference_logprobs"]["config"]["pairs"] = "preference_pairs"
        config["ops"]["dpo_checkpoint"]["config"]["pairs"] = "preference_pairs"
        chain = job.execute_in_process(instance=dpo_run.instance, run_config=config)
        final = _manifests("dpo", chain.run_id)[-1]
        evaluation = dpo_run.defs.resolve_job_def("dpo_eval").execute_in_process(
            instance=dpo_run.instance, partition_key=final.partition, run_config={"ops": {"dpo_eval_report": {"config": EVAL}}}
        )
    assert final.related["pairs"]["asset"] == "preference_pairs" and final.parent_partition is None
    assert {"preference_pairs", "preference_comparisons"} <= set(final.upstream) and "rl_problems" not in final.upstream
    assert final.upstream["preference_comparisons"]["metadata"]["source"] == "hh_rlhf"
    rows = _report_rows(dpo_run.state, final.partition)
    assert set(rows) == {"pair_accuracy", "margin", "dpo_loss"} and rows["pair_accuracy"]["parent"] is None
    heldout = [r for r in pq.read_table(dpo_run.state / "parquet" / "preference_pairs.parquet").to_pylist() if r["split"] == "heldout"]
    assert rows["margin"]["n"] == min(len(heldout), EVAL["max_heldout_sequences"]) > 0
    assert abs(rows["margin"]["base"]) < 1e-3  # the base model is this run's reference: no margin
    assert evaluation.success
    assert_manifest_names_exactly_the_tables_read(dpo_run.defs, final)
    lineage = json.loads(_lineage_json(dpo_run, final.partition))
    hop = lineage["hops"][0]
    datasets = {entry["asset"]: entry for entry in hop["datasets"]}
    assert datasets["preference_pairs"]["data_version"] == final.upstream["preference_pairs"]["data_version"]
    assert datasets["preference_comparisons"]["source"] == "hh_rlhf" and "onpolicy_pairs" not in datasets
    (report,) = [r for r in hop["eval_reports"] if r["run_id"] == evaluation.run_id]
    assert report["data_versions"] == {"preference_pairs": final.upstream["preference_pairs"]["data_version"]}


def _lineage_json(run, reference: str) -> str:
    result = subprocess.run([sys.executable, "-m", "pipelines", "lineage", reference, "--json"], cwd=REPO,
                            env={**os.environ, **run.env}, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_every_manifest_names_exactly_the_tables_it_read(dpo_run):
    manifests = _manifests("dpo")
    assert manifests
    for manifest in manifests:  # on-policy pairs; and, when the offline test ran first, offline pairs too
        assert_manifest_names_exactly_the_tables_read(dpo_run.defs, manifest)


def test_accumulated_comparisons_add_another_policys_and_refuse_it_twice(dpo_run):
    """`accumulate` (iterated RLHF): the latest DPO checkpoint's graded answers join the SFT checkpoint's in one
    new table version; the same sampler again fails with a clear message and stores nothing. (Last in this file:
    it changes the latest comparisons table the tests above read.)"""
    from assets.dpo import onpolicy_comparisons
    from assets.problems import rl_problems

    (sft,) = _manifests("sft")
    dpo = _manifests("dpo")[-1]
    config = {"ops": {"rl_problems": {"config": {"limit": 16, "heldout_fraction": 0.25}},
                      "onpolicy_comparisons": {"config": {"group_size": 4, "max_tokens": 6, "sampler": dpo.partition,
                                                          "accumulate": True}}}}
    path = dpo_run.state / "parquet" / "onpolicy_comparisons.parquet"
    before = pq.read_table(path).to_pylist()
    result = dg.materialize([rl_problems, onpolicy_comparisons], instance=dpo_run.instance,
                            resources=tiny_resources(dpo_run.state), run_config=config)
    metadata = _metadata(result, "onpolicy_comparisons")
    assert metadata["samplers"] == [sft.sampler_path, dpo.sampler_path] and metadata["kept_rows"] == len(before)
    assert metadata["kept_version"] == _data_version(dpo_run.chain, "onpolicy_comparisons")
    rows = pq.read_table(path).to_pylist()
    assert rows[: len(before)] == before and len(rows) == 2 * len(before)
    assert {row["source"] for row in rows[len(before):]} == {"onpolicy:" + dpo.sampler_path}
    assert all(row["row_id"].endswith("@1") for row in rows[len(before):])  # the same prompts, unique ids
    again = dg.materialize([rl_problems, onpolicy_comparisons], instance=dpo_run.instance,
                           resources=tiny_resources(dpo_run.state), run_config=config, raise_on_error=False)
    assert not again.success
    description = again.failure_data_for_node("onpolicy_comparisons").user_failure_data.description
    assert f"already hold the answers of {dpo.sampler_path}" in description
    assert pq.read_table(path).to_pylist() == rows
