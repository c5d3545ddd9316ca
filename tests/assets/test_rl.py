"""The RL asset module without a training run: launchpad config, env/config errors, the rollout table helpers."""

from pathlib import Path

import dagster as dg
import pyarrow as pa
import pytest

from assets.chaining import ParentCheckpoint
from assets.checkpoint_manifest import CheckpointManifest
from assets.config_bridge import DEFAULT_DOC, library_config
from assets.rl import RL, build_rl
from assets.rollouts import band, curve_markdown, groups_markdown, plot_curve, rollout_table, step_summary, summary_table
from assets.training import RecipeInputs, training_config_class
from posttrain.datasets.loaders import LoadSpec, load
from posttrain.rl.config import RLConfig
from posttrain.training.rows import JsonlRowSink
from tests.fixtures.dagster_env import TINY_MODEL


@pytest.fixture(scope="module")
def problems_table() -> pa.Table:
    return load(LoadSpec(kind="rl", source="reasoning_gym:basic_arithmetic", limit=12, heldout_fraction=0.25)).table


def _inputs(tmp_path: Path, table: pa.Table, parent: ParentCheckpoint | None = None, **values) -> RecipeInputs:
    config = RLConfig(**values)
    config.training.base_model, config.training.log_dir = TINY_MODEL, str(tmp_path / "run")
    config.training.init_from = parent.state_path if parent else None
    return RecipeInputs(None, config, None, {"rl_problems": table}, {}, TINY_MODEL, parent, None, str(tmp_path / "run"))


def test_launchpad_config_documents_every_field_and_takes_dict_options():
    config_class = training_config_class(RL)
    undocumented = [name for name, field in config_class.model_fields.items() if not field.description or field.description == DEFAULT_DOC]
    assert undocumented == []
    assert config_class.model_fields["env"].default == "problems" and config_class.model_fields["init_from"].default == "latest:sft"
    launch = config_class(env_options={"split": "train", "num_epochs": 2}, loss_fn="dro", loss_fn_config={"beta": 0.05}, group_size=2)
    library = library_config(launch, RLConfig, log_dir="/tmp/run", base_model=TINY_MODEL, init_from=None)
    assert library.env_options == {"split": "train", "num_epochs": 2} and library.loss_fn_config == {"beta": 0.05}
    assert library.group_size == 2 and library.training.log_dir == "/tmp/run"


def test_problems_env_trains_on_the_train_split_and_writes_rollouts_under_the_log_dir(tmp_path, problems_table):
    run = build_rl(_inputs(tmp_path, problems_table, env="problems", group_size=2, groups_per_batch=2))
    train_rows = [row for row in problems_table.to_pylist() if row["split"] == "train"]
    assert run.recipe.num_steps() == len(train_rows) // 2
    assert run.recipe.identity()["dataset"]["num_problems"] == len(train_rows)
    assert [Path(sink.path) for sink in run.row_sinks] == [tmp_path / "run" / "rollouts.jsonl"]
    assert run.renderer == "chatml"
    assert run.related["env"] == {"name": "problems", "options": {}, "problems_table": True, "format_coef": 0.1}


def test_the_kl_penalty_is_measured_from_the_parent_checkpoint_the_run_starts_from(tmp_path, problems_table):
    state, sampler = "tinker://sft-run/weights/000040", "tinker://sft-run/sampler_weights/000040"
    manifest = CheckpointManifest(
        partition="sft-abc-000040", recipe="sft", name="sft", step=40, epoch=None, final=True, state_path=state,
        sampler_path=sampler, base_model=TINY_MODEL, base_model_digest="", renderer="chatml", training_dagster_run_id="",
        training_asset="sft_checkpoint", log_dir="", mlflow_run_id="", mlflow_run_url="", registered_model="", model_version="",
    )
    values = {"env": "problems", "group_size": 2, "groups_per_batch": 2, "kl_penalty_coef": 0.05}
    run = build_rl(_inputs(tmp_path, problems_table, ParentCheckpoint(state, manifest), **values))
    assert run.recipe.identity()["rl"]["kl_reference"] == sampler
    # A raw tinker:// path that no registered checkpoint owns has no sampler weights to measure the KL from.
    with pytest.raises(dg.Failure, match="kl_reference='base'"):
        build_rl(_inputs(tmp_path, problems_table, ParentCheckpoint(state, None), **values))
    assert build_rl(_inputs(tmp_path, problems_table, ParentCheckpoint(state, None), kl_reference="base", **values)).recipe


@pytest.mark.parametrize("env", ["gsm8k", "arithmetic", "guess_number", "reasoning_gym:chain_sum"])
def test_envs_that_would_load_or_generate_examples_on_the_side_are_refused(tmp_path, problems_table, env):
    with pytest.raises(dg.Failure, match=r"on the side.*rl_problems source=.*env='problems'"):
        build_rl(_inputs(tmp_path, problems_table, env=env))


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"env": "chess"}, "env='chess'"),
        ({"env": "problems", "env_options": {"shuffle": True}}, "shuffle"),
        ({"env": "problems", "renderer": "nope"}, "renderer='nope'"),
        ({"group_size": 0}, "group_size must be >= 1"),
        ({"loss_fn": "dro"}, "loss_fn 'dro' needs loss_fn_config"),
        ({"env": "problems", "groups_per_batch": 50}, "groups_per_batch=50"),
        ({"env": "problems", "env_options": {"split": "heldout"}}, "env_options.split='heldout'"),
    ],
)
def test_bad_env_or_config_fails_naming_the_field(tmp_path, problems_table, values, named):
    with pytest.raises(dg.Failure) as failure:
        build_rl(_inputs(tmp_path, problems_table, **values))
    assert named in str(failure.value.description)


def _row(step: int, group: str, sample: int, reward: float, correct: float | None = None, **extra) -> dict:
    return {"step": step, "group": group, "sample": sample, "tags": [], "prompt": "What is 1 + 1?", "prompt_tokens": [1, 2],
            "completion": f"answer {sample}", "completion_tokens": [3, 4], "sampler_logprobs": [-0.1, -0.2], "reward": reward,
            "advantage": 0.0, "trained": True, "num_turns": 1, "correct": correct, "sampler_step": step,
            "sampler_path": f"tinker://run/sampler_weights/rl-step{step:06d}", **extra}


def test_rollout_table_orders_rows_adds_provenance_and_summarises_each_step(tmp_path):
    sink = JsonlRowSink(tmp_path / "rollouts.jsonl")
    sink.write_rows(1, [_row(1, "1.10", 0, 0.0, 0.0), _row(1, "1.2", 1, 1.0, 1.0), _row(1, "1.2", 0, 0.0, 0.0)])
    sink.write_rows(0, [_row(0, "0.0", 0, -0.1, 0.0, sandbox_status="failed")])
    table = rollout_table(sink.read(), training_run_id="abc", mlflow_run_id="m1")
    assert [(r["step"], r["group"], r["sample"]) for r in table.to_pylist()] == [(0, "0.0", 0), (1, "1.2", 0), (1, "1.2", 1), (1, "1.10", 0)]
    assert set(table.column("training_run_id").to_pylist()) == {"abc"} and table.column("sandbox_status").to_pylist()[:2] == ["failed", None]
    summary = step_summary(table)
    assert [s["samples"] for s in summary] == [1, 3]
    assert summary[1]["reward_mean"] == pytest.approx(1 / 3) and summary[1]["accuracy"] == pytest.approx(1 / 3)
    assert summary[1]["reward_std"] == pytest.approx((2 / 9) ** 0.5)
    table_value = summary_table(summary)  # shown inline on the asset page
    assert [column.name for column in table_value.schema.columns] == ["step", "samples", "reward_mean", "reward_std", "accuracy"]
    assert table_value.records[1].data == {"step": 1, "samples": 3, "reward_mean": 0.3333, "reward_std": 0.4714, "accuracy": 0.3333}
    preview = groups_markdown(table)
    assert preview.index("**group 1.2**") < preview.index("**group 1.10**") and "group 0.0" not in preview
    assert plot_curve(summary, tmp_path / "curve.png", "t").read_bytes()[:4] == b"\x89PNG"


def test_the_reward_band_stays_within_the_reward_range_and_the_curve_renders_inline():
    low, high = band([0.9, 0.5, 0.05], [0.3, 0.6, 0.1])
    assert low == pytest.approx([0.6, 0.0, 0.0]) and high == pytest.approx([1.0, 1.0, 0.15])
    low, _ = band([0.5, -0.05], [0.6, 0.2])  # a format penalty can take a mean below 0: the band still holds it
    assert low == pytest.approx([-0.05, -0.05])
    markdown = curve_markdown("run123", "rollouts/abc.png")
    assert markdown.startswith("![") and "(/mlflow/get-artifact?path=rollouts%2Fabc.png&run_uuid=run123)" in markdown
    assert len(markdown) < 1000  # Dagster's UI renders shorter markdown inline, longer behind "[Show Markdown]"
