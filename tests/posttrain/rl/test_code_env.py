"""The code env: rewards from real sandboxed tests, graded per group, with status and output in the rows."""

import pytest
import tinker

from posttrain.datasets.loaders import LoadSpec, load
from posttrain.renderers import get_renderer
from posttrain.rl.config import RLConfig
from posttrain.rl.envs import build_rl_dataset
from posttrain.rl.envs.code_env import CODE_BLOCK_REQUEST, code_prompt
from posttrain.rl.recipe import RLRecipe
from posttrain.rl.rollouts import rollout_group
from posttrain.rl.types import Trajectory, Transition
from posttrain.completers import TokensWithLogprobs
from posttrain.training.config import TrainingConfig
from tests.fixtures.server import TINY_MODEL
from tests.posttrain.supervised.tiny_data import tiny_tokenizer


@pytest.fixture(scope="module")
def renderer():
    return get_renderer("chatml", tiny_tokenizer())


@pytest.fixture(scope="module")
def code_table():
    return load(LoadSpec(kind="code", source="code_tasks:easy?count=40", heldout_fraction=0.25)).table


def reply(renderer, text: str) -> list[int]:
    return tiny_tokenizer().encode(text, add_special_tokens=False) + list(renderer.get_stop_sequences())


def answers_for(problem) -> dict[str, str]:
    signature = problem.starter_code.strip()
    return {
        "right": f"Here it is:\n```python\n{problem.reference_solution}```",
        "wrong": f"```python\n{signature}\n    return None\n```",
        "no_block": problem.reference_solution,
        "hangs": f"```python\n{signature}\n    while True:\n        pass\n```",
    }


def graded_group(builder, renderer, texts: list[str]):
    envs = builder.make_envs()
    trajectories = []
    for env, text in zip(envs, texts, strict=True):
        observation, _ = env.initial_observation()
        tokens = reply(renderer, text)
        result = env.step(tokens)
        assert result.episode_done and result.reward == 0.0  # the group grades
        action = TokensWithLogprobs(tokens, [-1.0] * len(tokens), "stop")
        trajectories.append(Trajectory([Transition(observation, action, result.reward, True)]))
    return builder.compute_group_rewards(trajectories, envs), builder.trajectory_logs(envs)


def test_group_rewards_follow_the_cookbook_and_logs_carry_sandbox_status_and_output(renderer, code_table):
    dataset = build_rl_dataset("code", renderer, group_size=4, groups_per_batch=2, seed=1, table=code_table, options={"timeout_s": 1.0})
    builder = dataset.get_batch(0)[0]
    assert builder.problem.split == "train" and builder.limits.timeout_s == 1.0
    observation, stop = builder.make_envs()[0].initial_observation()
    prompt = tiny_tokenizer().decode(observation.to_ints())
    assert builder.problem.prompt in prompt and "```python" in prompt and stop == renderer.get_stop_sequences()

    answers = answers_for(builder.problem)
    rewards, logs = graded_group(builder, renderer, [answers[name] for name in ("right", "wrong", "no_block", "hangs")])
    assert [reward for reward, _ in rewards] == [1.0, 0.0, pytest.approx(-0.1), 0.0]
    assert [m["correct"] for _, m in rewards] == [1.0, 0.0, 0.0, 0.0]
    assert [m["has_code_block"] for _, m in rewards] == [1.0, 1.0, 0.0, 1.0]
    assert [log["sandbox_status"] for log in logs] == ["passed", "failed", "no_code_block", "timeout"]
    assert rewards[3][1]["status/timeout"] == 1.0 and rewards[0][1]["status/timeout"] == 0.0
    assert "AssertionError" in logs[1]["test_output"]


def test_dataset_trains_on_the_train_split_only_and_is_deterministic(renderer, code_table):
    dataset = build_rl_dataset("code", renderer, group_size=2, groups_per_batch=3, seed=5, table=code_table, options={"num_epochs": 2})
    again = build_rl_dataset("code", renderer, group_size=2, groups_per_batch=3, seed=5, table=code_table, options={"num_epochs": 2})
    train_ids = {row["row_id"] for row in code_table.to_pylist() if row["split"] == "train"}
    assert 0 < len(train_ids) < code_table.num_rows  # the held-out rows exist and are never trained on
    assert len(dataset) == len(train_ids) // 3 * 2
    first_epoch = [b.problem.row_id for index in range(len(dataset) // 2) for b in dataset.get_batch(index)]
    assert len(set(first_epoch)) == len(first_epoch) and set(first_epoch) <= train_ids
    assert [b.problem.row_id for b in dataset.get_batch(1)] == [b.problem.row_id for b in again.get_batch(1)]
    assert dataset.identity() == again.identity() and dataset.identity()["dataset"] == "code"


def test_prompts_without_a_block_request_get_one():
    problem = type("P", (), {"prompt": "Write f(x) returning x."})()
    assert code_prompt(problem).endswith(CODE_BLOCK_REQUEST)
    asking = type("P", (), {"prompt": "Write f. Reply in one ```python code block."})()
    assert code_prompt(asking) == asking.prompt


def test_config_errors_name_the_table_and_the_options(renderer, code_table):
    with pytest.raises(ValueError, match="'code' needs a code_problems table"):
        build_rl_dataset("code", renderer, group_size=2, groups_per_batch=2)
    with pytest.raises(ValueError, match=r"no options \['limit'\].*timeout_s"):
        build_rl_dataset("code", renderer, group_size=2, groups_per_batch=2, table=code_table, options={"limit": 3})
    with pytest.raises(ValueError, match="does not match the 'code_problems' schema"):
        build_rl_dataset("code", renderer, group_size=2, groups_per_batch=2, table=code_table.drop(["test_code"]))
    with pytest.raises(ValueError, match="groups_per_batch=99 exceeds"):
        build_rl_dataset("code", renderer, group_size=2, groups_per_batch=99, table=code_table)


def test_a_real_rl_step_on_the_code_env_reports_status_rows_and_metrics(service_client, tmp_path, renderer, code_table):
    training = TrainingConfig(base_model=TINY_MODEL, lora_rank=4, learning_rate=1e-3, log_dir=str(tmp_path / "run"), seed=3)
    config = RLConfig(training=training, env="code", group_size=2, groups_per_batch=2, max_tokens=8, remove_constant_reward_groups=False)
    dataset = build_rl_dataset("code", renderer, group_size=2, groups_per_batch=2, seed=3, table=code_table)
    recipe = RLRecipe(config, dataset, tiny_tokenizer())
    client = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4).result()
    recipe.start(client, service_client, 0)
    try:
        outcome = recipe.submit_step(0, client, tinker.AdamParams(learning_rate=1e-3)).result()
    finally:
        recipe.close()
    assert len(outcome.rows) == 4
    for row in outcome.rows:
        assert row["sandbox_status"] in {"passed", "failed", "timeout", "crashed", "sandbox_error", "no_code_block"}
        assert isinstance(row["test_output"], str) and row["tags"] == ["code"]
        expected = {"passed": 1.0, "no_code_block": -0.1}.get(row["sandbox_status"], 0.0)
        assert row["reward"] == pytest.approx(expected)
    metrics = outcome.metrics
    assert metrics["accuracy"] == metrics["env/correct"] == sum(r["sandbox_status"] == "passed" for r in outcome.rows) / 4
    assert metrics["env/status/no_code_block"] == sum(r["sandbox_status"] == "no_code_block" for r in outcome.rows) / 4
    assert metrics["reward/mean"] == pytest.approx(sum(r["reward"] for r in outcome.rows) / 4)


def test_rollout_group_grades_a_whole_group_at_once(renderer, code_table):
    """rollout_group -> TrajectoryGroup: final rewards and logs come from the group's sandbox grading."""

    class ScriptedCompleter:
        def __init__(self, texts):
            self.texts = texts

        def submit(self, observation, stop, *, num_samples=1, seed=None):
            tokens = [reply(renderer, text) for text in self.texts[:num_samples]]
            return type("Pending", (), {"result": lambda _: [TokensWithLogprobs(t, [-1.0] * len(t), "stop") for t in tokens]})()

    builder = build_rl_dataset("code", renderer, group_size=2, groups_per_batch=1, table=code_table).get_batch(0)[0]
    answers = answers_for(builder.problem)
    group = rollout_group(builder, ScriptedCompleter([answers["right"], answers["wrong"]]), seed=0)
    assert group.total_rewards() == [1.0, 0.0]
    assert [log["sandbox_status"] for log in group.logs_G] == ["passed", "failed"]
