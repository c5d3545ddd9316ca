"""Real Dagster materializations of the data assets, stored by the parquet IO manager."""

import hashlib
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from assets.base_model import base_model
from assets.data_assets import DATA_ASSETS
from assets.datasets import SourceConfig, chat_dataset
from assets.preferences import ComparisonSourceConfig, PairRenderConfig, preference_comparisons, preference_pairs
from assets.problems import CodeSourceConfig, ProblemSourceConfig, code_problems, rl_problems
from assets.tokens import RenderConfig, rendered_tokens
from posttrain.datasets import schemas, summary
from posttrain.datasets.splits import split_of
from posttrain.datasets.tokens import TokenizerIdentity, TokenizerMismatch, check_tokenizer_matches, recorded_tokenizer
from resources.parquet_io import ParquetIOManager
from resources.tinker import TinkerResource
from tests.fixtures.data import TINY_MODEL, chat_line

ARITHMETIC = "reasoning_gym:basic_arithmetic,chain_sum"


@dg.asset
def downstream_of_tokens(rendered_tokens) -> None:
    """Stands in for the SFT asset: it must not run when a blocking check fails."""


def resources(base: Path) -> dict:
    # base_url given: base_model resolves the tiny model's directory without starting a server
    tinker = TinkerResource(backend="local", base_url="http://127.0.0.1:9", base_model=TINY_MODEL)
    return {"io_manager": ParquetIOManager(base_dir=str(base)), "tinker": tinker}


def run(assets: list, base: Path, ops: dict, raise_on_error: bool = True, instance=None, selection=None) -> dg.ExecuteInProcessResult:
    return dg.materialize(
        assets,
        resources=resources(base),
        run_config=dg.RunConfig(ops=ops),
        instance=instance or dg.DagsterInstance.ephemeral(),
        raise_on_error=raise_on_error,
        selection=selection,
    )


def metadata_of(result: dg.ExecuteInProcessResult, name: str) -> dict:
    return {key: value.value for key, value in result.asset_materializations_for_node(name)[0].metadata.items()}


def checks_of(result: dg.ExecuteInProcessResult) -> dict[tuple[str, str], bool]:
    return {(e.asset_key.path[-1], e.check_name): e.passed for e in result.get_asset_check_evaluations()}


def test_sft_chain_writes_checked_tokens_with_metadata(tmp_path: Path):
    ops = {
        "chat_dataset": SourceConfig(source=ARITHMETIC, limit=20, heldout_fraction=0.2),
        "rendered_tokens": RenderConfig(max_length=512),
    }
    result = run([base_model, chat_dataset, rendered_tokens], tmp_path, ops)
    assert all(checks_of(result).values()) and len(checks_of(result)) == 5
    chat = pq.read_table(tmp_path / "chat_dataset.parquet")
    tokens = pq.read_table(tmp_path / "rendered_tokens.parquet")
    assert chat.num_rows == tokens.num_rows == 20
    assert tokens.column("source_row_id").to_pylist() == chat.column("row_id").to_pylist()
    expected_splits = [split_of(m[0]["content"], 0.2) for m in chat.column("messages").to_pylist()]
    assert tokens.column("split").to_pylist() == expected_splits and "heldout" in expected_splits
    assert tokens.schema.remove_metadata().equals(schemas.RENDERED_TOKENS.remove_metadata())

    meta = metadata_of(result, "rendered_tokens")
    assert meta["dagster/row_count"] == 20 and meta["split/heldout"] == expected_splits.count("heldout")
    assert [c.name for c in meta["dagster/column_schema"].columns] == schemas.RENDERED_TOKENS.names
    assert meta["data_digest"] == summary.data_digest(tokens)  # digest survives the parquet round trip
    num_tokens = tokens.column("num_tokens").to_pylist()
    assert meta["tokens/max"] == max(num_tokens) and meta["tokens/min"] == min(num_tokens)
    trained = sum(tokens.column("num_trained_tokens").to_pylist())
    assert meta["trained_token_fraction"] == pytest.approx(trained / (sum(num_tokens) - 20), abs=1e-4)
    assert meta["truncated_rows"] == 0
    first_answer = chat.column("messages").to_pylist()[0][1]["content"]
    assert f"⟦{first_answer}<|im_end|>⟧" in meta["preview"]
    event = result.asset_materializations_for_node("rendered_tokens")[0]
    assert event.tags["dagster/data_version"] == meta["data_digest"]


def test_same_config_gives_same_data_version(tmp_path: Path):
    ops = {"chat_dataset": SourceConfig(source=ARITHMETIC, limit=8)}
    first = metadata_of(run([chat_dataset], tmp_path / "a", ops), "chat_dataset")["data_digest"]
    again = metadata_of(run([chat_dataset], tmp_path / "b", ops), "chat_dataset")["data_digest"]
    other = metadata_of(run([chat_dataset], tmp_path / "c", {"chat_dataset": SourceConfig(source=ARITHMETIC, limit=8, seed=1)}), "chat_dataset")
    assert first == again != other["data_digest"]


def test_preference_chain_pairs_share_prompt_and_differ(tmp_path: Path):
    ops = {
        "preference_comparisons": ComparisonSourceConfig(limit=12, heldout_fraction=0.25),
        "preference_pairs": PairRenderConfig(),
    }
    result = run([base_model, preference_comparisons, preference_pairs], tmp_path, ops)
    assert all(checks_of(result).values()) and ("preference_pairs", "pairs_differ_and_share_prompt") in checks_of(result)
    pairs = pq.read_table(tmp_path / "preference_pairs.parquet").to_pylist()
    assert len(pairs) >= 10
    for pair in pairs:
        length = pair["prompt_length"]
        assert pair["chosen_model_input"][:length] == pair["rejected_model_input"][:length]
        assert pair["chosen_target_tokens"] != pair["rejected_target_tokens"]
        assert all(w == 0 for w in pair["chosen_weights"][: length - 1])
    meta = metadata_of(result, "preference_pairs")
    assert "⟦" in meta["preview"] and meta["tokenizer_name"] == TINY_MODEL
    stored = pq.read_table(tmp_path / "preference_pairs.parquet")
    assert recorded_tokenizer(stored) == TokenizerIdentity(TINY_MODEL, meta["tokenizer_digest"])


def test_problem_sets(tmp_path: Path):
    ops = {"rl_problems": ProblemSourceConfig(limit=10), "code_problems": CodeSourceConfig(source="human_eval")}
    result = run([rl_problems, code_problems], tmp_path, ops)
    assert checks_of(result) == {
        ("rl_problems", "schema_valid"): True,
        ("rl_problems", "gold_answers_verified"): True,
        ("code_problems", "schema_valid"): True,
        ("code_problems", "has_tests"): True,
    }
    assert metadata_of(result, "code_problems")["dagster/row_count"] == 164
    assert pq.read_table(tmp_path / "rl_problems.parquet").num_rows == 10


def test_preset_from_local_hub_mirror(tmp_path: Path, hub_mirror):
    result = run([chat_dataset], tmp_path, {"chat_dataset": SourceConfig(source="no_robots", heldout_fraction=0.0)})
    meta = metadata_of(result, "chat_dataset")
    assert meta["dagster/row_count"] == 3 and meta["source"] == "no_robots"
    assert "Write a haiku about rain." in meta["preview"]


def test_bad_row_fails_naming_line_and_writes_nothing(tmp_path: Path, write_jsonl):
    path = write_jsonl([chat_line("a", "b"), chat_line("c", "d") | {"messages": [{"role": "user", "content": 5}]}])
    result = run([chat_dataset], tmp_path / "store", {"chat_dataset": SourceConfig(source=str(path))}, raise_on_error=False)
    assert not result.success
    failure = result.failure_data_for_node("chat_dataset").user_failure_data.description
    assert f"{path} line 2 message 0: user message content is int, expected a string" in failure
    assert not (tmp_path / "store").exists() or list((tmp_path / "store").rglob("*")) == []


def test_skip_bad_rows_reports_count_and_samples(tmp_path: Path, write_jsonl):
    path = write_jsonl([chat_line("a", "b"), "{broken", chat_line("c", "d")])
    result = run([chat_dataset], tmp_path, {"chat_dataset": SourceConfig(source=str(path), skip_bad_rows=True)})
    meta = metadata_of(result, "chat_dataset")
    assert meta["dagster/row_count"] == 2 and meta["skipped_rows"] == 1
    assert f"{path} line 2: malformed JSON" in meta["skipped_samples"]
    assert meta["rows_read"] == 3 and meta["source_kind"] == "local"
    assert meta["revision"] == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_default_reads_the_whole_split_and_records_where_it_came_from(tmp_path: Path, write_jsonl, hub_mirror):
    path = write_jsonl([chat_line(f"q{i}", f"a{i}") for i in range(450)])
    meta = metadata_of(run([chat_dataset], tmp_path / "a", {"chat_dataset": SourceConfig(source=str(path))}), "chat_dataset")
    assert meta["dagster/row_count"] == 450 == meta["rows_read"]
    assert meta["split/train"] + meta["split/heldout"] == 450
    preset = metadata_of(run([chat_dataset], tmp_path / "b", {"chat_dataset": SourceConfig(source="no_robots")}), "chat_dataset")
    assert (preset["source_kind"], preset["source_split"]) == ("mirror", "train")
    assert preset["source_location"] == str(hub_mirror / "HuggingFaceH4" / "no_robots")
    assert preset["revision"].startswith("sha256:") and preset["rows_read"] == 3


def test_unknown_renderer_fails_before_writing_tokens(tmp_path: Path):
    ops = {"chat_dataset": SourceConfig(limit=4), "rendered_tokens": RenderConfig(renderer="nope")}
    result = run([base_model, chat_dataset, rendered_tokens], tmp_path, ops, raise_on_error=False)
    assert not result.success
    assert "unknown renderer 'nope'" in result.failure_data_for_node("rendered_tokens").user_failure_data.description
    assert (tmp_path / "chat_dataset.parquet").is_file() and not (tmp_path / "rendered_tokens.parquet").exists()


def test_blocking_check_fails_the_run_and_stores_nothing_in_the_same_run(tmp_path: Path):
    mixed = "reasoning_gym:chain_sum,gsm_symbolic"  # short vs long questions
    ops = {
        "chat_dataset": SourceConfig(source=mixed, limit=6, heldout_fraction=0.0),
        "rendered_tokens": RenderConfig(max_length=48),
    }
    assets = [base_model, chat_dataset, rendered_tokens, downstream_of_tokens]
    result = run(assets, tmp_path, ops, raise_on_error=False)
    assert checks_of(result)[("rendered_tokens", "every_example_trained")] is False  # recorded as a failed check
    assert checks_of(result)[("rendered_tokens", "within_max_length")] is True
    failure = result.failure_data_for_node("rendered_tokens").user_failure_data.description
    assert failure.startswith("rendered_tokens: blocking check(s) failed, table not stored")
    assert "every_example_trained" in failure and "gsm_symbolic" in failure
    assert result.asset_materializations_for_node("rendered_tokens") == []
    assert result.asset_materializations_for_node("downstream_of_tokens") == []
    assert not (tmp_path / "rendered_tokens.parquet").exists()

    ops["rendered_tokens"] = RenderConfig(max_length=48, skip_bad_rows=True)
    result = run(assets, tmp_path / "skip", ops)
    meta = metadata_of(result, "rendered_tokens")
    assert 3 <= meta["skipped_rows"] < 6 and meta["dagster/row_count"] == 6 - meta["skipped_rows"]
    assert "gsm_symbolic" in meta["skipped_samples"] and "no trained tokens" in meta["skipped_samples"]
    assert all(checks_of(result).values())


def test_a_later_run_never_reads_a_table_that_failed_a_blocking_check(tmp_path: Path):
    instance = dg.DagsterInstance.ephemeral()
    assets = [base_model, chat_dataset, rendered_tokens, downstream_of_tokens]
    source = {"chat_dataset": SourceConfig(source="reasoning_gym:chain_sum,gsm_symbolic", limit=6, heldout_fraction=0.0)}
    failing = {**source, "rendered_tokens": RenderConfig(max_length=48)}
    data_only = ["base_model", "chat_dataset", "rendered_tokens"]
    assert not run(assets, tmp_path, failing, raise_on_error=False, instance=instance, selection=data_only).success
    later = run(assets, tmp_path, {}, raise_on_error=False, instance=instance, selection=["downstream_of_tokens"])
    assert not later.success  # nothing stored to read: "materialize the upstream asset first"
    assert "materialize the upstream asset first" in str(later.failure_data_for_node("downstream_of_tokens").error)

    good = run(assets, tmp_path, {**source, "rendered_tokens": RenderConfig(max_length=512)}, instance=instance, selection=data_only)
    good_digest = metadata_of(good, "rendered_tokens")["data_digest"]
    assert not run(assets, tmp_path, failing, raise_on_error=False, instance=instance, selection=data_only).success
    assert summary.data_digest(pq.read_table(tmp_path / "rendered_tokens.parquet")) == good_digest  # untouched
    later = run(assets, tmp_path, {}, instance=instance, selection=["downstream_of_tokens"])
    assert later.success  # reads the last table that passed its checks, the one the latest materialization names
    latest = instance.get_latest_materialization_event(dg.AssetKey("rendered_tokens")).asset_materialization
    assert latest.metadata["data_digest"].value == good_digest


def test_token_assets_take_the_tokenizer_of_the_materialized_base_model(tmp_path: Path):
    ops = {"chat_dataset": SourceConfig(source=ARITHMETIC, limit=6), "rendered_tokens": RenderConfig()}
    missing = run([base_model, chat_dataset, rendered_tokens], tmp_path, ops, raise_on_error=False,
                  selection=["chat_dataset", "rendered_tokens"])
    assert "base_model has never been materialized" in missing.failure_data_for_node("rendered_tokens").user_failure_data.description

    result = run([base_model, chat_dataset, rendered_tokens], tmp_path, ops)
    base = metadata_of(result, "base_model")
    meta = metadata_of(result, "rendered_tokens")
    identity = TokenizerIdentity(base["tokenizer_name"], base["tokenizer_digest"])
    assert identity.name == TINY_MODEL and (meta["tokenizer_name"], meta["tokenizer_digest"]) == (identity.name, identity.digest)
    stored = pq.read_table(tmp_path / "rendered_tokens.parquet")
    assert check_tokenizer_matches(stored, identity) == identity
    with pytest.raises(TokenizerMismatch, match="rendered with 'localtinker/tiny-random'.*uses 'other/model'"):
        check_tokenizer_matches(stored, TokenizerIdentity("other/model", "0" * 64))


def test_held_out_prompts_never_train_in_another_materialization(tmp_path: Path, write_jsonl):
    questions = [f"What is {i} minus {60 - i}?" for i in range(60)]
    lines = [chat_line(q, a) for q in questions for a in ("first", "second")]  # every prompt twice
    path = write_jsonl(lines[::3] + lines[1::3] + lines[2::3])
    tables = {}
    for limit in (35, 120):
        ops = {
            "chat_dataset": SourceConfig(source=str(path), limit=limit, heldout_fraction=0.3),
            "rl_problems": ProblemSourceConfig(limit=limit // 3, heldout_fraction=0.3),
            "preference_comparisons": ComparisonSourceConfig(limit=limit // 3, heldout_fraction=0.3),
            "code_problems": CodeSourceConfig(limit=limit, heldout_fraction=0.3),
        }
        run([chat_dataset, rl_problems, preference_comparisons, code_problems], tmp_path / str(limit), ops)
        tables[limit] = {name: pq.read_table(tmp_path / str(limit) / f"{name}.parquet").to_pylist() for name in ops}
    prompt_of = {
        "chat_dataset": lambda row: row["messages"][0]["content"],
        "rl_problems": lambda row: row["question"],
        "preference_comparisons": lambda row: row["prompt"][0]["content"],
        "code_problems": lambda row: row["prompt"],
    }
    for name, prompt in prompt_of.items():
        sides: dict[str, set[str]] = {}
        for limit in tables:
            for row in tables[limit][name]:
                sides.setdefault(prompt(row), set()).add(row["split"])
        assert all(len(splits) == 1 for splits in sides.values()), name  # no prompt on both sides, in or across runs
        assert {"train", "heldout"} <= set().union(*sides.values()), name


def test_pairs_truncated_to_nothing_fail_clearly_even_when_skipping(tmp_path: Path):
    ops = {
        "preference_comparisons": ComparisonSourceConfig(limit=4),
        "preference_pairs": PairRenderConfig(max_length=10, skip_bad_rows=True),
    }
    result = run([base_model, preference_comparisons, preference_pairs], tmp_path, ops, raise_on_error=False)
    description = result.failure_data_for_node("preference_pairs").user_failure_data.description
    assert description == "preference_pairs: no pairs left (4 had an untrained side)"
    assert not (tmp_path / "preference_pairs.parquet").exists()


def test_data_asset_graph_groups_kinds_and_blocking_checks(tmp_path: Path):
    defs = dg.Definitions(assets=list(DATA_ASSETS), resources=resources(tmp_path))
    dg.Definitions.validate_loadable(defs)
    graph = {}
    for asset in DATA_ASSETS:
        key = asset.key.to_user_string()
        specs = list(asset.check_specs)
        assert all(spec.blocking for spec in specs), key
        graph[key] = (asset.group_names_by_key[asset.key], sorted(asset.specs_by_key[asset.key].kinds),
                      sorted(dep.asset_key.to_user_string() for dep in asset.specs_by_key[asset.key].deps),
                      sorted(spec.name for spec in specs))
    assert graph == {
        "base_model": ("training", ["huggingface", "tinker"], [], []),
        "chat_dataset": ("data", ["huggingface", "parquet"], [], ["has_assistant_turns", "schema_valid"]),
        "rendered_tokens": ("data", ["parquet"], ["base_model", "chat_dataset"], ["every_example_trained", "schema_valid", "within_max_length"]),
        "preference_comparisons": ("data", ["huggingface", "parquet"], [], ["pairs_differ", "schema_valid"]),
        "preference_pairs": ("data", ["parquet"], ["base_model", "preference_comparisons"], ["pairs_differ_and_share_prompt", "schema_valid", "within_max_length"]),
        "rl_problems": ("data", ["huggingface", "parquet"], [], ["gold_answers_verified", "schema_valid"]),
        "code_problems": ("data", ["huggingface", "parquet"], [], ["has_tests", "schema_valid"]),
    }
