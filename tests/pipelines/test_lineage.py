"""`python -m pipelines lineage` on a real checkpoint made by the SFT chain."""

import os
import subprocess
import sys
from pathlib import Path

from assets.checkpoint_manifest import all_manifests
from resources.mlflow_links import absolute_mlflow_url

REPO = Path(__file__).resolve().parents[2]


def _lineage(run, *args):
    env = {**os.environ, **run.env}
    return subprocess.run(
        [sys.executable, "-m", "pipelines", "lineage", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )


def test_lineage_by_tinker_path_and_by_model_version_prints_the_whole_chain(sft_pipeline_run):
    run = sft_pipeline_run
    final = max((m for m in all_manifests() if m.training_dagster_run_id == run.chain.run_id), key=lambda m: m.step)
    tokens = run.instance.fetch_materializations(__import__("dagster").AssetKey("rendered_tokens"), limit=1).records[0]
    chat = run.instance.fetch_materializations(__import__("dagster").AssetKey("chat_dataset"), limit=1).records[0]

    by_path = _lineage(run, final.state_path)
    assert by_path.returncode == 0, by_path.stderr
    out = by_path.stdout
    expected_in_order = [
        f"checkpoint      {final.partition}  (sft, step 6, final)",
        final.state_path,
        f"Dagster {run.chain.run_id}  job sft_chain, SUCCESS",
        absolute_mlflow_url(final.mlflow_run_url),
        "started from  the base model",
        f"rendered_tokens @ {tokens.asset_materialization.tags['dagster/data_version']}",
        f"chat_dataset @ {chat.asset_materialization.tags['dagster/data_version']}",
        "reasoning_gym:",
        "eval report   run ",
        "base model      localtinker/tiny-random",
        final.base_model_digest,
    ]
    position = 0
    for piece in expected_in_order:  # each piece appears, in this order
        position = out.find(piece, position)
        assert position >= 0, f"{piece!r} missing (in order) from:\n{out}"

    by_version = _lineage(run, f"{final.registered_model}/{final.model_version}")
    assert by_version.returncode == 0, by_version.stderr
    assert by_version.stdout == out


def test_lineage_of_an_unknown_checkpoint_says_what_to_pass(sft_pipeline_run):
    result = _lineage(sft_pipeline_run, "tinker://nope/weights/000001")
    assert result.returncode == 2
    assert "pass a tinker:// path" in result.stderr


def test_lineage_json_lists_each_hops_datasets_with_version_source_revision_and_rows(sft_pipeline_run):
    import json

    import dagster as dg

    run = sft_pipeline_run
    final = max((m for m in all_manifests() if m.training_dagster_run_id == run.chain.run_id), key=lambda m: m.step)
    chat = run.instance.fetch_materializations(dg.AssetKey("chat_dataset"), limit=1).records[0].asset_materialization
    result = _lineage(run, final.partition, "--json")
    assert result.returncode == 0, result.stderr
    lineage = json.loads(result.stdout)
    assert lineage["checkpoint"] == final.partition and len(lineage["hops"]) == 1
    hop = lineage["hops"][0]
    assert (hop["partition"], hop["recipe"], hop["step"], hop["started_from"]) == (final.partition, "sft", 6, None)
    assert hop["training_run"]["dagster_run_id"] == run.chain.run_id and hop["training_run"]["job"] == "sft_chain"
    datasets = {entry["asset"]: entry for entry in hop["datasets"]}
    assert set(datasets) == {"chat_dataset", "rendered_tokens"}
    data = datasets["chat_dataset"]
    assert data["data_version"] == chat.tags["dagster/data_version"]
    assert data["source"] == "reasoning_gym:basic_arithmetic,chain_sum" and data["source_kind"] == "generator"
    assert data["revision"].startswith("reasoning-gym ") and data["revision"].endswith("seed 0")
    assert data["rows"] == 48 == data["splits"]["train"] + data["splits"]["heldout"]
    assert datasets["rendered_tokens"]["rows"] > 0 and datasets["rendered_tokens"]["data_version"]
    assert lineage["base_model"]["name"] == "localtinker/tiny-random"
    assert lineage["base_model"]["digest"] == final.base_model_digest
    assert hop["eval_reports"] and hop["eval_reports"][0]["run_id"]
