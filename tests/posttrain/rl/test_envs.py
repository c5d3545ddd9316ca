"""Environments with the tiny model's real tokenizer and the chatml renderer (no server needed)."""

import pyarrow as pa
import pytest

from posttrain.datasets.schemas import RL_PROBLEMS
from posttrain.rl.data import MASK_KEY, trajectory_to_datums
from posttrain.completers import TokensWithLogprobs
from posttrain.rl.envs import ENV_NAMES, build_rl_dataset
from posttrain.rl.envs.guess_number import GuessNumberEnv
from posttrain.rl.types import Trajectory, Transition
from posttrain.renderers import get_renderer
from tests.posttrain.supervised.tiny_data import tiny_tokenizer


@pytest.fixture(scope="module")
def renderer():
    return get_renderer("chatml", tiny_tokenizer())


def reply(renderer, text: str, closed: bool = True) -> list[int]:
    tokens = tiny_tokenizer().encode(text, add_special_tokens=False)
    return tokens + list(renderer.get_stop_sequences()) if closed else tokens


def test_arithmetic_batches_are_deterministic_and_graded_by_value(renderer):
    dataset = build_rl_dataset("arithmetic", renderer, group_size=3, groups_per_batch=2, seed=7, num_batches=5)
    again = build_rl_dataset("arithmetic", renderer, group_size=3, groups_per_batch=2, seed=7, num_batches=5)
    assert len(dataset) == 5
    problems = [builder.problem for builder in dataset.get_batch(4)]
    assert problems == [builder.problem for builder in again.get_batch(4)]
    assert problems != [builder.problem for builder in dataset.get_batch(3)]
    problem = problems[0]
    x, y = (int(n) for n in problem.question.removeprefix("What is ").removesuffix("?").split(" + "))
    assert 0 <= x <= 100 and 0 <= y <= 100 and problem.answer == str(x + y)

    envs = dataset.get_batch(4)[0].make_envs()
    assert len(envs) == 3
    observation, stop = envs[0].initial_observation()
    assert "What is" in tiny_tokenizer().decode(observation.to_ints()) and stop == renderer.get_stop_sequences()
    assert envs[0].step(reply(renderer, f"The answer is {x + y}.")).reward == 1.0
    assert envs[1].step(reply(renderer, f"The answer is {x + y + 1}.")).reward == 0.0
    truncated = envs[2].step(reply(renderer, f"The answer is {x + y}", closed=False))
    assert truncated.reward == pytest.approx(0.9) and truncated.metrics["format"] == 0.0


def test_reasoning_gym_tasks_use_their_own_scorer_as_reward(renderer):
    dataset = build_rl_dataset("reasoning_gym:basic_arithmetic", renderer, group_size=2, groups_per_batch=4, options={"limit": 8})
    assert len(dataset) == 2
    builder = dataset.get_batch(0)[0]
    assert builder.problem.scorer == "reasoning_gym:basic_arithmetic" and builder.logging_tags() == ["basic_arithmetic"]
    right, wrong = builder.make_envs()
    assert right.step(reply(renderer, f"Answer: {builder.problem.answer}")).reward == 1.0
    assert wrong.step(reply(renderer, "Answer: banana")).reward < 0.5


def test_problems_table_and_gsm8k_from_the_local_hub_mirror(renderer, hub_mirror):
    rows = [
        {"row_id": f"r{i}", "source": "t", "split": "train" if i < 4 else "heldout", "task": "sum",
         "question": f"What is {i} + 1?", "answer": str(i + 1), "scorer": "exact_number", "scorer_metadata": "{}"}
        for i in range(6)
    ]
    table = pa.Table.from_pylist(rows, schema=RL_PROBLEMS)
    dataset = build_rl_dataset("problems", renderer, group_size=2, groups_per_batch=2, table=table, seed=1, options={"num_epochs": 2})
    assert len(dataset) == 4  # 4 train problems / 2 per batch × 2 epochs
    seen = sorted(b.problem.row_id for index in range(2) for b in dataset.get_batch(index))
    assert seen == ["r0", "r1", "r2", "r3"]  # every train problem once per epoch, no held-out row

    gsm8k = build_rl_dataset("gsm8k", renderer, group_size=2, groups_per_batch=2, options={"limit": 4})
    problem = gsm8k.get_batch(0)[0].problem
    env = gsm8k.get_batch(0)[0].make_envs()[0]
    assert env.step(reply(renderer, f"#### {problem.answer}")).reward == 1.0


def test_bad_env_names_and_options_are_refused_with_the_valid_ones(renderer):
    with pytest.raises(ValueError, match="valid envs: arithmetic, guess_number") as error:
        build_rl_dataset("arithmatic", renderer, group_size=2, groups_per_batch=2)
    assert all(name in str(error.value) for name in ENV_NAMES)
    with pytest.raises(ValueError, match=r"no options \['colour'\].*max_turns"):
        build_rl_dataset("guess_number", renderer, group_size=2, groups_per_batch=2, options={"colour": 1})
    with pytest.raises(ValueError, match="needs an rl_problems table"):
        build_rl_dataset("problems", renderer, group_size=2, groups_per_batch=2)
    with pytest.raises(ValueError, match="unknown reasoning-gym task"):
        build_rl_dataset("reasoning_gym:no_such_task", renderer, group_size=2, groups_per_batch=2)
    with pytest.raises(ValueError, match="group_size"):
        build_rl_dataset("arithmetic", renderer, group_size=0, groups_per_batch=2)


def test_guess_the_number_answers_higher_lower_and_its_turns_merge_into_one_datum(renderer):
    env = GuessNumberEnv(renderer, secret=42, max_turns=3)
    observation, _ = env.initial_observation()
    transitions = []
    for guess, expected in ((10, "Higher."), (50, "Lower.")):
        action = reply(renderer, str(guess))
        result = env.step(action)
        assert not result.episode_done and result.reward == 0.0
        assert tiny_tokenizer().decode(result.next_observation.to_ints()).rstrip().endswith(f"{expected}<|im_end|>\n<|im_start|>assistant")
        transitions.append(Transition(observation, TokensWithLogprobs(action, [-1.0] * len(action), "stop"), 0.0, False))
        observation = result.next_observation
    action = reply(renderer, "42")
    final = env.step(action)
    assert final.episode_done and final.reward == 1.0 and final.metrics["turns"] == 3.0
    transitions.append(Transition(observation, TokensWithLogprobs(action, [-1.0] * len(action), "stop"), 1.0, True))

    [datum] = trajectory_to_datums(Trajectory(transitions), advantage=1.0)
    mask = datum.loss_fn_inputs[MASK_KEY].to_numpy()
    assert int(mask.sum()) == sum(len(t.action.tokens) for t in transitions)
    assert datum.model_input.length + 1 == observation.length + len(action)

    out_of_turns = GuessNumberEnv(renderer, secret=42, max_turns=1)
    last = out_of_turns.step(reply(renderer, "7"))
    assert last.episode_done and last.reward == 0.0 and last.metrics["solved"] == 0.0
