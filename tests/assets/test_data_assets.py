"""Real Dagster materializations of the data assets, stored by the parquet IO manager."""

from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from assets.datasets import SourceConfig, chat_dataset
from assets.preferences import ComparisonSourceConfig, PairRenderConfig, preference_comparisons, preference_pairs
from assets.problems import CodeSourceConfig, ProblemSourceConfig, code_problems, rl_problems
from assets.tokens import RenderConfig, rendered_tokens
from posttrain.datasets import schemas, summary
from resources.parquet_io import ParquetIOManager
from tests.fixtures.data import TINY_MODEL, chat_line

ARITHMETIC = "reasoning_gym:basic_arithmetic,chain_sum"


@dg.asset
def downstream_of_tokens(rendered_tokens) -> None:
    """Stands in for the SFT asset: it must not run when a blocking check fails."""


def run(assets: list, base: Path, ops: dict, raise_on_error: bool = True, instance=None) -> dg.ExecuteInProcessResult:
    return dg.materialize(
        assets,
        resources={"io_manager": ParquetIOManager(base_dir=str(base))},
        run_config=dg.RunConfig(ops=ops),
        instance=instance or dg.DagsterInstance.ephemeral(),
        raise_on_error=raise_on_error,
    )


def metadata_of(result: dg.ExecuteInProcessResult, name: str) -> dict:
    return {key: value.value for key, value in result.asset_materializations_for_node(name)[0].metadata.items()}


def checks_of(result: dg.ExecuteInProcessResult) -> dict[tuple[str, str], bool]:
    return {(e.asset_key.path[-1], e.check_name): e.passed for e in result.get_asset_check_evaluations()}


def test_sft_chain_writes_checked_tokens_with_metadata(tmp_path: Path):
    ops = {
        "chat_dataset": SourceConfig(source=ARITHMETIC, limit=20, heldout_fraction=0.2),
        "rendered_tokens": RenderConfig(base_model=TINY_MODEL, max_length=512),
    }
    result = run([chat_dataset, rendered_tokens], tmp_path, ops)
    assert all(checks_of(result).values()) and len(checks_of(result)) == 5
    chat = pq.read_table(tmp_path / "chat_dataset.parquet")
    tokens = pq.read_table(tmp_path / "rendered_tokens.parquet")
    assert chat.num_rows == tokens.num_rows == 20
    assert tokens.column("source_row_id").to_pylist() == chat.column("row_id").to_pylist()
    assert tokens.column("split").to_pylist().count("heldout") == 4
    assert tokens.schema.remove_metadata().equals(schemas.RENDERED_TOKENS.remove_metadata())

    meta = metadata_of(result, "rendered_tokens")
    assert meta["dagster/row_count"] == 20 and meta["split/heldout"] == 4
    assert [c.name for c in meta["dagster/column_schema"].columns] == schemas.RENDERED_TOKENS.names
    assert meta["data_digest"] == summary.data_digest(tokens)  # digest survives the parquet round trip
    num_tokens = tokens.column("num_tokens").to_pylist()
    assert meta["tokens/max"] == max(num_tokens) and meta["tokens/min"] == min(num_tokens)
    trained = sum(tokens.column("num_trained_tokens").to_pylist())
    assert meta["trained_token_fraction"] == pytest.approx(trained / (sum(num_tokens) - 20), abs=1e-4)
    assert meta["truncated_rows"] == 0
    first_answer = chat.column("messages").to_pylist()[0][1]["content"]
    assert f"⟦{first_answer}<|im_end|>" in meta["preview"]
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
        "preference_pairs": PairRenderConfig(base_model=TINY_MODEL),
    }
    result = run([preference_comparisons, preference_pairs], tmp_path, ops)
    assert all(checks_of(result).values()) and ("preference_pairs", "pairs_differ_and_share_prompt") in checks_of(result)
    pairs = pq.read_table(tmp_path / "preference_pairs.parquet").to_pylist()
    assert len(pairs) >= 10
    for pair in pairs:
        length = pair["prompt_length"]
        assert pair["chosen_model_input"][:length] == pair["rejected_model_input"][:length]
        assert pair["chosen_target_tokens"] != pair["rejected_target_tokens"]
        assert all(w == 0 for w in pair["chosen_weights"][: length - 1])
    assert "⟦" in metadata_of(result, "preference_pairs")["preview"]


def test_problem_sets(tmp_path: Path):
    ops = {"rl_problems": ProblemSourceConfig(limit=10), "code_problems": CodeSourceConfig()}
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


def test_unknown_renderer_fails_before_writing_tokens(tmp_path: Path):
    ops = {"chat_dataset": SourceConfig(limit=4), "rendered_tokens": RenderConfig(renderer="nope", base_model=TINY_MODEL)}
    result = run([chat_dataset, rendered_tokens], tmp_path, ops, raise_on_error=False)
    assert not result.success
    assert "unknown renderer 'nope'" in result.failure_data_for_node("rendered_tokens").user_failure_data.description
    assert (tmp_path / "chat_dataset.parquet").is_file() and not (tmp_path / "rendered_tokens.parquet").exists()


def test_blocking_check_stops_training_on_untrained_examples(tmp_path: Path):
    mixed = "reasoning_gym:chain_sum,gsm_symbolic"  # short vs long questions
    ops = {
        "chat_dataset": SourceConfig(source=mixed, limit=6, heldout_fraction=0.0),
        "rendered_tokens": RenderConfig(base_model=TINY_MODEL, max_length=48),
    }
    result = run([chat_dataset, rendered_tokens, downstream_of_tokens], tmp_path, ops, raise_on_error=False)
    assert checks_of(result)[("rendered_tokens", "every_example_trained")] is False
    assert checks_of(result)[("rendered_tokens", "within_max_length")] is True
    assert result.asset_materializations_for_node("downstream_of_tokens") == []
    assert metadata_of(result, "rendered_tokens")["truncated_rows"] >= 3
    untrained = pq.read_table(tmp_path / "rendered_tokens.parquet").column("num_trained_tokens").to_pylist().count(0)
    assert 3 <= untrained < 6  # every gsm_symbolic question is longer than 48 tokens, chain_sum ones are not

    ops["rendered_tokens"] = RenderConfig(base_model=TINY_MODEL, max_length=48, skip_bad_rows=True)
    result = run([chat_dataset, rendered_tokens, downstream_of_tokens], tmp_path / "skip", ops)
    meta = metadata_of(result, "rendered_tokens")
    assert meta["skipped_rows"] == untrained and meta["dagster/row_count"] == 6 - untrained
    assert "gsm_symbolic" in meta["skipped_samples"] and "no trained tokens" in meta["skipped_samples"]
    assert all(checks_of(result).values())


def test_pairs_truncated_to_nothing_fail_clearly_even_when_skipping(tmp_path: Path):
    ops = {
        "preference_comparisons": ComparisonSourceConfig(limit=4),
        "preference_pairs": PairRenderConfig(base_model=TINY_MODEL, max_length=10, skip_bad_rows=True),
    }
    result = run([preference_comparisons, preference_pairs], tmp_path, ops, raise_on_error=False)
    description = result.failure_data_for_node("preference_pairs").user_failure_data.description
    assert description == "preference_pairs: no pairs left (4 had an untrained side)"
    assert not (tmp_path / "preference_pairs.parquet").exists()


def test_data_asset_graph_groups_kinds_and_blocking_checks():
    assets = [chat_dataset, rendered_tokens, preference_comparisons, preference_pairs, rl_problems, code_problems]
    defs = dg.Definitions(assets=assets, resources={"io_manager": ParquetIOManager(base_dir="/tmp/unused")})
    dg.Definitions.validate_loadable(defs)
    graph = {}
    for asset in assets:
        key = asset.key.to_user_string()
        specs = list(asset.check_specs)
        assert all(spec.blocking for spec in specs), key
        graph[key] = (asset.group_names_by_key[asset.key], sorted(asset.specs_by_key[asset.key].kinds),
                      sorted(dep.asset_key.to_user_string() for dep in asset.specs_by_key[asset.key].deps),
                      sorted(spec.name for spec in specs))
    assert graph == {
        "chat_dataset": ("data", ["huggingface", "parquet"], [], ["has_assistant_turns", "schema_valid"]),
        "rendered_tokens": ("data", ["parquet"], ["chat_dataset"], ["every_example_trained", "schema_valid", "within_max_length"]),
        "preference_comparisons": ("data", ["huggingface", "parquet"], [], ["pairs_differ", "schema_valid"]),
        "preference_pairs": ("data", ["parquet"], ["preference_comparisons"], ["pairs_differ_and_share_prompt", "schema_valid", "within_max_length"]),
        "rl_problems": ("data", ["huggingface", "parquet"], [], ["gold_answers_verified", "schema_valid"]),
        "code_problems": ("data", ["huggingface", "parquet"], [], ["has_tests", "schema_valid"]),
    }
