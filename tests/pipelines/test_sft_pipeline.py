"""The whole SFT slice on the tiny model: a real sqlite Dagster instance and a real sqlite MLflow store."""

import json

import dagster as dg
import pyarrow.parquet as pq
from mlflow.entities import RunStatus

from assets.checkpoint_manifest import all_manifests
from tests.fixtures.lineage_audit import assert_manifest_names_exactly_the_tables_read
from resources.mlflow import TAG_ASSET_KEY, TAG_DAGSTER_RUN_ID, TAG_PARTITION


def _metadata(result, node):
    (materialization,) = [m for m in result.asset_materializations_for_node(node) if m.asset_key == dg.AssetKey(node)]
    return {key: getattr(value, "value", value) for key, value in materialization.metadata.items()}


def test_chain_turns_every_saved_checkpoint_into_a_partition_with_a_manifest(sft_pipeline_run):
    run = sft_pipeline_run
    assert run.chain.success
    partitions = run.instance.get_dynamic_partitions("sft_checkpoints")
    manifests = [m for m in all_manifests() if m.training_dagster_run_id == run.chain.run_id]
    assert sorted(m.partition for m in manifests) == sorted(partitions)
    assert [m.step for m in sorted(manifests, key=lambda m: m.step)] == [3, 6]
    metadata = _metadata(run.chain, "sft_checkpoint")
    assert metadata["total_steps"] == 6
    assert [c["partition"] for c in metadata["checkpoints"]] == [m.partition for m in sorted(manifests, key=lambda m: m.step)]
    assert metadata["final_state_path"].startswith("tinker://") and "/weights/" in metadata["final_state_path"]
    assert metadata["final_sampler_path"].startswith("tinker://") and "/sampler_weights/" in metadata["final_sampler_path"]
    assert metadata["mlflow_run"].startswith("/mlflow/#/experiments/")  # relative to the Dagster UI, which proxies MLflow
    assert metadata["base_model"] == "localtinker/tiny-random"
    assert metadata["final_loss"] > 0


def test_training_is_one_mlflow_run_with_per_step_metrics_datasets_and_model_versions(sft_pipeline_run):
    run = sft_pipeline_run
    client = run.mlflow.get_client()
    experiment = run.mlflow.experiment_id(client)
    (training,) = client.search_runs([experiment], f"tags.`{TAG_DAGSTER_RUN_ID}` = '{run.chain.run_id}'")
    assert training.info.status == RunStatus.to_string(RunStatus.FINISHED)
    assert training.data.tags[TAG_ASSET_KEY] == "sft_checkpoint"
    loss = client.get_metric_history(training.info.run_id, "loss")
    assert [m.step for m in loss] == list(range(6))
    assert all(m.value > 0 for m in loss)
    assert [m.step for m in client.get_metric_history(training.info.run_id, "learning_rate")] == list(range(6))
    assert len(client.get_metric_history(training.info.run_id, "tokens_per_second")) == 6
    assert training.data.params["batch_size"] == "4" and training.data.params["base_model"] == "localtinker/tiny-random"
    assert not any("key" in name.lower() for name in training.data.params)

    versions = {d.dataset.name: d.dataset.digest for d in training.inputs.dataset_inputs}
    for asset in ("rendered_tokens", "chat_dataset"):
        record = run.instance.fetch_materializations(dg.AssetKey(asset), limit=1).records[0]
        assert versions[asset] == record.asset_materialization.tags["dagster/data_version"][:36]
    chat_profile = json.loads(next(d.dataset.profile for d in training.inputs.dataset_inputs if d.dataset.name == "chat_dataset"))
    assert chat_profile["dagster/row_count"] == 48 and chat_profile["source_kind"] == "generator"
    assert chat_profile["revision"].startswith("reasoning-gym ")  # the Datasets tab says which data, at which version

    model_versions = sorted(client.search_model_versions("name='sft'"), key=lambda v: int(v.version))
    manifests = sorted((m for m in all_manifests() if m.training_dagster_run_id == run.chain.run_id), key=lambda m: m.step)
    assert [v.source for v in model_versions] == [m.state_path for m in manifests]
    for version, manifest in zip(model_versions, manifests):
        assert version.run_id == training.info.run_id
        assert version.tags["tinker_path"] == manifest.state_path
        assert version.tags["base_model"] == "localtinker/tiny-random"
        assert version.tags["training_run"] == run.chain.run_id
        assert version.tags["dagster.partition"] == manifest.partition
        assert version.tags["rendered_tokens.data_version"] == manifest.upstream["rendered_tokens"]["data_version"]
        assert version.tags["chat_dataset.data_version"] == manifest.upstream["chat_dataset"]["data_version"]


def _report_rows(run, partition):
    table = pq.read_table(run.state / "parquet" / "sft_eval_report" / f"{partition}.parquet")
    return {row["metric"]: row for row in table.to_pylist()}


def test_automation_requested_evals_produce_reports_checks_and_mlflow_runs(sft_pipeline_run):
    run = sft_pipeline_run
    partitions = run.instance.get_dynamic_partitions("sft_checkpoints")
    assert run.requested_partitions == sorted(partitions)  # every new checkpoint, once
    client = run.mlflow.get_client()
    for partition, result in run.evals.items():
        assert result.success
        metadata = _metadata(result, "sft_eval_report")
        assert metadata["checkpoint"] == partition and metadata["score_metric"] == "nll"
        assert "| nll |" in metadata["report"] and "| bpb |" in metadata["report"] and "| accuracy |" not in metadata["report"]
        assert not any(key.startswith(("checkpoint_", "base_nll", "mlflow_aliases")) for key in metadata)  # one table, no raw floats
        rows = _report_rows(run, partition)
        assert set(rows) == {"nll", "bpb"}
        assert rows["nll"]["n"] == 8 and rows["nll"]["checkpoint_stderr"] > 0  # max_heldout_sequences
        assert abs(rows["nll"]["delta_base"] - (rows["nll"]["checkpoint"] - rows["nll"]["base"])) < 1e-9  # paired on every item
        assert rows["nll"]["parent"] is None  # trained from the base model: no parent column
        (check,) = result.get_asset_check_evaluations()
        assert check.check_name == "improves_on_base" and check.severity == dg.AssetCheckSeverity.WARN
        assert check.passed == (not [m for m in ("nll", "bpb") if rows[m]["vs_base"] == "worse"])
        (eval_run,) = client.search_runs(
            [run.mlflow.experiment_id(client)],
            f"tags.`{TAG_PARTITION}` = '{partition}' and tags.`{TAG_ASSET_KEY}` = 'sft_eval_report'",
        )
        assert eval_run.data.metrics["eval/nll"] == rows["nll"]["checkpoint"]
        assert eval_run.data.metrics["eval/nll_stderr"] == rows["nll"]["checkpoint_stderr"]
        assert eval_run.data.metrics["base/nll"] == rows["nll"]["base"]
        manifest = next(m for m in all_manifests() if m.partition == partition)
        assert metadata["sampler_path"] == manifest.sampler_path  # its own checkpoint, looked up by partition
        version = client.get_model_version(manifest.registered_model, manifest.model_version)
        assert float(version.tags["eval.nll"]) == float(f"{rows['nll']['checkpoint']:.6g}")
    nll = {p: _report_rows(run, p)["nll"]["checkpoint"] for p in run.evals}
    assert float(client.get_model_version_by_alias("sft", "best").tags["eval.nll"]) == float(f"{min(nll.values()):.6g}")


def test_training_lowers_held_out_nll_of_the_tiny_model(sft_pipeline_run):
    """Six steps at lr 1e-3 on a random model must already beat it on held-out NLL (a real training signal)."""
    final = max((m for m in all_manifests() if m.training_dagster_run_id == sft_pipeline_run.chain.run_id), key=lambda m: m.step)
    row = _report_rows(sft_pipeline_run, final.partition)["nll"]
    assert row["checkpoint"] < row["base"] and row["vs_base"] == "better"


def test_every_manifest_names_exactly_the_tables_it_read(sft_pipeline_run):
    manifests = [m for m in all_manifests() if m.recipe == "sft"]
    assert manifests
    for manifest in manifests:
        assert_manifest_names_exactly_the_tables_read(sft_pipeline_run.defs, manifest)


def test_the_demo_evaluates_a_checkpoint_it_names_and_reads_its_report_back(sft_pipeline_run):
    """``scripts/demo_stage.py --evaluate``: the stage's eval job on one partition, its rows read from the parquet."""
    from pipelines.demo import DemoStage, evaluate_checkpoint
    from tests.fixtures.dagster_env import TINY_EVAL_CONFIG

    run = sft_pipeline_run
    first = run.requested_partitions[0]
    assert first not in run.evals  # not evaluated by the fixture: this call makes its report
    stage = DemoStage("sft", {}, eval_config=TINY_EVAL_CONFIG["ops"]["sft_eval_report"]["config"])
    rows = evaluate_checkpoint(run.defs, run.instance, stage, first)
    assert rows == _report_rows(run, first)
    assert rows["nll"]["n"] > 0 and rows["nll"]["base"] is not None
