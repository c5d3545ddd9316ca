"""RLHF on the tiny model, end to end: sft_chain → preference_model_chain (on-policy comparisons of the SFT
checkpoint → preference model) → rlhf_chain (RL from SFT, rewarded by that preference model's tournaments) →
eval reports → lineage names every edge; preference models trained on HH-RLHF, UltraFeedback and HelpSteer3
comparisons (local fixtures in their schema) by config; bad judges and empty comparisons fail with a clear
message and register nothing.

A random tiny model never answers arithmetic correctly, so the verifier that picks chosen/rejected answers is
replaced by one that alternates correct / incorrect (as in the DPO pipeline test); everything else is real.
"""

import dataclasses
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

from assets.checkpoint_manifest import all_manifests, write_manifest
from resources.state import STATE_DIR_ENV, ensure_dagster_home
from tests.fixtures.dagster_env import TINY_MODEL, tiny_resources
from tests.fixtures.lineage_audit import assert_manifest_names_exactly_the_tables_read
from tests.fixtures.data import HUB_FIXTURES

pytestmark = pytest.mark.slow  # three chained trainings on the tiny model: ~4 minutes on 2 cores
REPO = Path(__file__).resolve().parents[2]
PROBLEMS = {"rl_problems": {"config": {"limit": 16, "heldout_fraction": 0.25}}}
SFT_CONFIG = {
    "ops": {
        "chat_dataset": {"config": {"limit": 16, "heldout_fraction": 0.25}},
        "sft_checkpoint": {"config": {"batch_size": 4, "max_steps": 1, "save_every": 0, "learning_rate": 1e-2, "lora_rank": 4}},
    }
}
PM_TRAINING = {"batch_size": 4, "max_steps": 2, "save_every": 1, "learning_rate": 1e-3}
PM_CONFIG = {
    "ops": {
        **PROBLEMS,
        "onpolicy_comparisons": {"config": {"group_size": 4, "max_tokens": 6}},
        "preference_model_checkpoint": {"config": PM_TRAINING},
    }
}
RLHF_TRAINING = {"max_steps": 2, "save_every": 1, "group_size": 3, "groups_per_batch": 2, "max_tokens": 4, "learning_rate": 1e-3}
RLHF_CONFIG = {"ops": {**PROBLEMS, "rlhf_checkpoint": {"config": RLHF_TRAINING}}}
EVAL = {"max_problems": 3, "max_tokens": 4, "max_heldout_sequences": 3}


class AlternatingJudge:
    """Grades answers 1, 0, 1, 0 ... in the order they are graded (a group of 4 is always mixed)."""

    def __init__(self) -> None:
        self.verdicts = itertools.cycle([1.0, 0.0])

    def __call__(self, extracted, problem) -> float:
        return next(self.verdicts)


@dataclass
class RlhfRun:
    state: Path
    instance: dg.DagsterInstance
    defs: dg.Definitions
    pm_chain: Any
    rlhf_chain: Any
    pm_eval: Any
    rlhf_eval: Any
    env: dict[str, str]


@pytest.fixture(scope="module")
def rlhf_run(tmp_path_factory: pytest.TempPathFactory):
    import assets.dpo
    from pipelines.definitions import build_definitions
    from resources.tinker import EMBEDDED_SERVERS

    state = tmp_path_factory.mktemp("rlhf_pipeline") / "state"
    env = {STATE_DIR_ENV: str(state), "DAGSTER_HOME": str(state / "dagster"), "POSTTRAIN_BASE_MODEL": TINY_MODEL,
           "POSTTRAIN_HUB_MIRROR": str(HUB_FIXTURES)}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        patch.setattr(assets.dpo, "grade_answer", AlternatingJudge())
        defs = build_definitions(tiny_resources(state))
        with dg.DagsterInstance.from_config(str(ensure_dagster_home())) as instance:
            assert defs.resolve_job_def("sft_chain").execute_in_process(instance=instance, run_config=SFT_CONFIG).success
            pm_chain = defs.resolve_job_def("preference_model_chain").execute_in_process(instance=instance, run_config=PM_CONFIG)
            rlhf_chain = defs.resolve_job_def("rlhf_chain").execute_in_process(instance=instance, run_config=RLHF_CONFIG)
            evals = [
                defs.resolve_job_def(f"{recipe}_eval").execute_in_process(
                    instance=instance, partition_key=_manifests(recipe)[-1].partition, run_config={"ops": {f"{recipe}_eval_report": {"config": EVAL}}}
                )
                for recipe in ("preference_model", "rlhf")
            ]
            try:
                yield RlhfRun(state, instance, defs, pm_chain, rlhf_chain, *evals, env)
            finally:
                EMBEDDED_SERVERS.stop_all()


def _metadata(result, node):
    (materialization,) = [m for m in result.asset_materializations_for_node(node) if m.asset_key == dg.AssetKey(node)]
    return {key: getattr(value, "value", value) for key, value in materialization.metadata.items()}


def _manifests(recipe, run_id=None):
    return sorted((m for m in all_manifests() if m.recipe == recipe and run_id in (None, m.training_dagster_run_id)), key=lambda m: m.step)


def _report(run: RlhfRun, recipe: str, partition: str) -> dict[str, dict]:
    path = run.state / "parquet" / f"{recipe}_eval_report" / f"{partition}.parquet"
    return {row["metric"]: row for row in pq.read_table(path).to_pylist()}


def test_the_preference_model_trains_on_the_sft_checkpoints_graded_comparisons(rlhf_run):
    assert rlhf_run.pm_chain.success
    (sft,) = _manifests("sft")
    manifests = _manifests("preference_model", rlhf_run.pm_chain.run_id)
    assert [m.step for m in manifests] == [1, 2]
    comparisons = _metadata(rlhf_run.pm_chain, "onpolicy_comparisons")
    assert comparisons["sampler_partition"] == sft.partition
    table = pq.read_table(rlhf_run.state / "parquet" / "onpolicy_comparisons.parquet")
    train_rows = table.column("split").to_pylist().count("train")
    for manifest in manifests:
        assert manifest.parent_partition == sft.partition
        assert manifest.related["comparisons"]["asset"] == "onpolicy_comparisons"
        assert manifest.related["comparisons"]["data_version"] == manifest.upstream["onpolicy_comparisons"]["data_version"]
        assert manifest.related["comparisons"]["num_train"] == 2 * train_rows  # both orders of each train comparison
    metadata = _metadata(rlhf_run.pm_chain, "preference_model_checkpoint")
    assert metadata["total_steps"] == 2 and 0.0 <= metadata["final_eval/comparison_accuracy"] <= 1.0


def test_rlhf_checkpoints_name_their_sft_parent_their_judge_and_its_comparisons(rlhf_run):
    assert rlhf_run.rlhf_chain.success
    (sft,) = _manifests("sft")
    judge = _manifests("preference_model")[-1]
    manifests = _manifests("rlhf", rlhf_run.rlhf_chain.run_id)
    assert [m.step for m in manifests] == [1, 2]
    for manifest in manifests:
        assert manifest.parent_partition == sft.partition and manifest.init_from == sft.state_path
        recorded = manifest.related["preference_model"]
        assert recorded["partition"] == judge.partition and recorded["sampler_path"] == judge.sampler_path
        assert recorded["comparisons"]["asset"] == "onpolicy_comparisons"
        assert recorded["comparisons"]["data_version"] == judge.upstream["onpolicy_comparisons"]["data_version"]
        assert manifest.related["prompts"]["asset"] == "rl_problems" and "rl_problems" in manifest.upstream
        assert manifest.related["tournament"] == {"pattern": "all_pairs_one_way", "chunk_size": 0, "judge_orders": "both"}
    metadata = _metadata(rlhf_run.rlhf_chain, "rlhf_checkpoint")
    assert metadata["total_steps"] == 2 and "final_env/win_fraction" in metadata and "final_env/position_bias" in metadata


def test_rlhf_rollouts_carry_their_pairwise_scores(rlhf_run):
    rows = pq.read_table(rlhf_run.state / "parquet" / "rlhf_rollout_batches.parquet").to_pylist()
    assert len(rows) == 2 * 2 * 3 and {row["step"] for row in rows} == {0, 1}
    for row in rows:
        scores = json.loads(row["pairwise_scores"])
        assert sorted(s["opponent"] for s in scores) == sorted({0, 1, 2} - {row["sample"]})
        win = sum(s["win"] for s in scores) / len(scores)
        assert win - 0.1 - 1e-6 <= row["reward"] <= win + 1e-6  # win fraction, less the format penalty
        assert row["correct"] in (0.0, 1.0)  # rl_problems prompts: the verifier's grade, logged, not rewarded


def test_eval_reports_score_the_judge_and_the_rlhf_checkpoint_against_its_parent(rlhf_run):
    assert rlhf_run.pm_eval.success and rlhf_run.rlhf_eval.success
    pm = _report(rlhf_run, "preference_model", _manifests("preference_model")[-1].partition)
    assert {"comparison_accuracy", "orders_agree", "position_bias", "accuracy_chosen_first", "accuracy_chosen_second"} <= set(pm)
    row = pm["comparison_accuracy"]
    assert row["n"] == 3 and 0.0 <= row["checkpoint"] <= 1.0 and row["parent"] is not None and row["delta_parent_stderr"] is not None
    rlhf = _report(rlhf_run, "rlhf", _manifests("rlhf")[-1].partition)
    assert {"win_rate", "accuracy", "judge_position_bias"} <= set(rlhf)
    assert rlhf["win_rate"]["parent"] == pytest.approx(0.5)  # the parent against itself: identical answers tie
    assert rlhf["win_rate"]["n"] == 3 and 0.0 <= rlhf["win_rate"]["checkpoint"] <= 1.0
    assert rlhf["verdict_win_rate"]["parent"] == pytest.approx(0.5) and rlhf["verdict_win_rate"]["n"] == 3
    assert rlhf["win_rate_verifier_tied"]["parent"] == pytest.approx(0.5)  # against itself every prompt is even
    assert rlhf["accuracy"]["n"] == 3 and rlhf["accuracy"]["delta_parent"] is not None  # the verifier, paired with the parent


def test_lineage_names_the_judge_and_its_comparison_data(rlhf_run):
    final = _manifests("rlhf")[-1]
    judge = _manifests("preference_model")[-1]
    result = subprocess.run([sys.executable, "-m", "pipelines", "lineage", final.partition], cwd=REPO,
                            env={**os.environ, **rlhf_run.env}, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert f"preference_model {judge.partition} (preference_model, step {judge.step})" in result.stdout
    assert "data          onpolicy_comparisons @" in result.stdout and "data          rl_problems @" in result.stdout


@pytest.mark.parametrize("preset", ["hh_rlhf", "ultrafeedback", "helpsteer3"])
def test_a_preference_model_trains_on_hub_comparisons_by_config(rlhf_run, preset):
    job = rlhf_run.defs.resolve_job_def("preference_model_train")
    data = dg.materialize(
        [next(a for a in rlhf_run.defs.assets if getattr(a, "key", None) == dg.AssetKey("preference_comparisons"))],
        instance=rlhf_run.instance, resources=tiny_resources(rlhf_run.state),
        run_config={"ops": {"preference_comparisons": {"config": {"source": preset, "limit": 12, "heldout_fraction": 0.25}}}},
    )
    assert data.success
    result = job.execute_in_process(
        instance=rlhf_run.instance,
        run_config={"ops": {"preference_model_checkpoint": {"config": {
            "comparisons": "preference_comparisons", "init_from": "", "batch_size": 4, "max_steps": 1, "save_every": 0, "lora_rank": 4}}}},
    )
    assert result.success
    (manifest,) = _manifests("preference_model", result.run_id)
    assert manifest.related["comparisons"]["asset"] == "preference_comparisons" and manifest.parent_partition is None
    assert manifest.upstream["preference_comparisons"]["metadata"]["source"].startswith(preset)


def _fails_without_registering(run: RlhfRun, job: str, op: str, config: dict, message: str) -> None:
    before = {name: run.instance.get_dynamic_partitions(f"{name}_checkpoints") for name in ("rlhf", "preference_model")}
    result = run.defs.resolve_job_def(job).execute_in_process(
        instance=run.instance, raise_on_error=False, run_config={"ops": {op: {"config": config}}}
    )
    assert not result.success
    description = result.failure_data_for_node(op).user_failure_data.description
    assert message in description, description
    assert {name: run.instance.get_dynamic_partitions(f"{name}_checkpoints") for name in before} == before
    assert not [m for m in all_manifests() if m.training_dagster_run_id == result.run_id]


def test_a_judge_that_is_not_a_preference_model_of_this_base_model_and_tokenizer_is_refused(rlhf_run):
    (sft,) = _manifests("sft")
    judge = _manifests("preference_model")[-1]
    training = {**RLHF_TRAINING, "max_steps": 1}
    _fails_without_registering(rlhf_run, "rlhf_train", "rlhf_checkpoint", {**training, "preference_model": sft.partition},
                               "is a sft checkpoint")
    other_base = dataclasses.replace(judge, partition="preference_model-0therb45-000001", base_model="other/model",
                                     state_path="tinker://other/weights/1", sampler_path="tinker://other/sampler_weights/1")
    write_manifest(other_base)
    _fails_without_registering(rlhf_run, "rlhf_train", "rlhf_checkpoint", {**training, "preference_model": other_base.partition},
                               "is a checkpoint of 'other/model'")
    other_tokenizer = dataclasses.replace(judge, partition="preference_model-0thert0k-000001", tokenizer="other-tokenizer@0123456789abcdef",
                                          state_path="tinker://tok/weights/1", sampler_path="tinker://tok/sampler_weights/1")
    write_manifest(other_tokenizer)
    _fails_without_registering(rlhf_run, "rlhf_train", "rlhf_checkpoint", {**training, "preference_model": other_tokenizer.partition},
                               "reads tokens of tokenizer other-tokenizer@0123456789abcdef")
    for manifest in (other_base, other_tokenizer):
        (rlhf_run.state / "checkpoints" / f"{manifest.partition}.json").unlink()


def test_comparisons_without_train_rows_are_refused_before_anything_is_stored_or_trained(rlhf_run, tmp_path):
    """The data layer refuses them (the recipe refuses an empty train split too: tests/posttrain/preference/test_rlhf.py)."""
    path = tmp_path / "comparisons.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say {i}.", "chosen": f"{i}", "rejected": f"not {i}"}) + "\n" for i in range(3)))
    key = dg.AssetKey("preference_comparisons")
    stored = len(rlhf_run.instance.fetch_materializations(key, limit=100).records)
    partitions = rlhf_run.instance.get_dynamic_partitions("preference_model_checkpoints")
    data = dg.materialize(
        [next(a for a in rlhf_run.defs.assets if getattr(a, "key", None) == key)],
        instance=rlhf_run.instance, resources=tiny_resources(rlhf_run.state), raise_on_error=False,
        run_config={"ops": {"preference_comparisons": {"config": {
            "source": str(path), "columns": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}, "heldout_fraction": 0.999}}}},
    )
    assert not data.success
    description = data.failure_data_for_node("preference_comparisons").user_failure_data.description
    assert "all 3 rows hash into the held-out split" in description and "lower heldout_fraction" in description
    assert len(rlhf_run.instance.fetch_materializations(key, limit=100).records) == stored
    assert rlhf_run.instance.get_dynamic_partitions("preference_model_checkpoints") == partitions


def test_a_judge_trained_with_reference_answers_writes_its_own_before_it_judges(rlhf_run):
    """reference=chosen: the judge trains with the verified chosen answer before each pair; its eval report and RLHF
    judge with its own answer there (recorded in the lineage, its answers graded live), or with another checkpoint's
    (judge_reference_from, refused for a judge without references); human preferences are refused."""
    run = lambda job, config, **kwargs: rlhf_run.defs.resolve_job_def(job).execute_in_process(  # noqa: E731
        instance=rlhf_run.instance, run_config=config, **kwargs)
    pm = run("preference_model_train", {"ops": {"preference_model_checkpoint": {"config": {
        **PM_TRAINING, "max_steps": 1, "save_every": 0, "reference": "chosen"}}}})
    assert pm.success
    (judge,) = _manifests("preference_model", pm.run_id)
    assert judge.related["comparisons"]["reference"] == "chosen"
    assert run("preference_model_eval", {"ops": {"preference_model_eval_report": {"config": EVAL}}}, partition_key=judge.partition).success
    report = _report(rlhf_run, "preference_model", judge.partition)
    assert report["own_answer_is_chosen"]["n"] == 3 and 0.0 <= report["own_answer_is_chosen"]["checkpoint"] <= 1.0
    assert report["comparison_accuracy"]["n"] == 3
    rlhf = run("rlhf_train", {"ops": {"rlhf_checkpoint": {"config": {**RLHF_TRAINING, "max_steps": 1, "preference_model": judge.partition}}}})
    assert rlhf.success
    (manifest,) = _manifests("rlhf", rlhf.run_id)
    assert manifest.related["preference_model"]["partition"] == judge.partition
    assert manifest.related["preference_model"]["answers_first"] is True
    assert 0.0 <= _metadata(rlhf, "rlhf_checkpoint")["final_env/judge_answer_correct"] <= 1.0
    assert "judge_reference" not in manifest.related  # the judge wrote its own answers
    (sft,) = _manifests("sft")
    answered = run("rlhf_train", {"ops": {"rlhf_checkpoint": {"config": {
        **RLHF_TRAINING, "max_steps": 1, "preference_model": judge.partition, "judge_reference_from": sft.partition}}}})
    assert answered.success
    (manifest,) = _manifests("rlhf", answered.run_id)
    assert manifest.related["judge_reference"] == {"partition": sft.partition, "sampler_path": sft.sampler_path}
    result = subprocess.run([sys.executable, "-m", "pipelines", "lineage", manifest.partition], cwd=REPO,
                            env={**os.environ, **rlhf_run.env}, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0 and f"judge_reference {sft.partition} (sft, step {sft.step})" in result.stdout, result.stdout
    plain_judge = _manifests("preference_model", rlhf_run.pm_chain.run_id)[-1]
    _fails_without_registering(rlhf_run, "rlhf_train", "rlhf_checkpoint",
                               {**RLHF_TRAINING, "max_steps": 1, "preference_model": plain_judge.partition, "judge_reference_from": sft.partition},
                               "was trained without references")
    assert dg.materialize(
        [next(a for a in rlhf_run.defs.assets if getattr(a, "key", None) == dg.AssetKey("preference_comparisons"))],
        instance=rlhf_run.instance, resources=tiny_resources(rlhf_run.state),
        run_config={"ops": {"preference_comparisons": {"config": {"source": "hh_rlhf", "limit": 12, "heldout_fraction": 0.25}}}},
    ).success
    _fails_without_registering(rlhf_run, "preference_model_train", "preference_model_checkpoint",
                               {**PM_TRAINING, "comparisons": "preference_comparisons", "reference": "chosen"},
                               "holds preferences, not verified answers")


def test_every_manifest_names_exactly_the_tables_it_read(rlhf_run):
    manifests = [m for m in all_manifests() if m.recipe in ("preference_model", "rlhf")]
    assert {m.recipe for m in manifests} == {"preference_model", "rlhf"}
    for manifest in manifests:
        assert_manifest_names_exactly_the_tables_read(rlhf_run.defs, manifest)
