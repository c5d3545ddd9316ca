"""Every RL env kind is fed from a materialized rl_problems table, trained on its train rows and evaluated
(the env's own reward, greedy accuracy, pass@k) on its held-out rows, multi-turn included."""

import re
from types import SimpleNamespace

import pyarrow as pa
import pytest

from assets.problems import ProblemSourceConfig, load_problems, unverified_answers
from posttrain.datasets.problems import rl_problems_from_table
from posttrain.eval.base import EvalTarget
from posttrain.renderers import get_renderer
from posttrain.rl.envs import build_rl_dataset
from posttrain.rl.envs.guess_number import GuessNumberGroupBuilder
from posttrain.rl.envs.instances import GUESS_NUMBER_SCORER, generate_rows
from posttrain.rl.envs.problem_env import ProblemGroupBuilder
from posttrain.rl.evaluation import EnvEvaluator
from tests.posttrain.supervised.tiny_data import tiny_tokenizer

SOURCES = {
    "arithmetic": {"source": "arithmetic?count=40&seed=3"},
    "guess_number": {"source": "guess_number?count=40&high=50&max_turns=7"},
    "reasoning_gym": {"source": "reasoning_gym:basic_arithmetic", "limit": 40},
    "gsm8k": {"source": "gsm8k", "heldout_fraction": 0.5},  # the local mirror of GSM8K (3 rows in its real schema)
}


@pytest.fixture(scope="module")
def renderer():
    return get_renderer("chatml", tiny_tokenizer())


class OraclePlayer:
    """A sampling client that plays well greedily: the gold answer of a known question, binary search in a
    guessing game; at temperature 1 only the first of its samples is right."""

    def __init__(self, renderer, gold: dict[str, str]):
        self.renderer, self.gold = renderer, gold

    def _answer(self, text: str) -> str:
        if "I am thinking of a whole number between" in text:
            low, high = (int(n) for n in re.search(r"between (\d+) and (\d+)", text).groups())
            turns = re.findall(r"<\|im_start\|>assistant\n(\d+)<\|im_end\|>\n<\|im_start\|>user\n(Higher|Lower)", text)
            for guess, feedback in turns:
                low, high = (int(guess) + 1, high) if feedback == "Higher" else (low, int(guess) - 1)
            return str((low + high) // 2)
        question = next(q for q in self.gold if q in text)
        return f"The answer is {self.gold[question]}."

    def sample(self, prompt, num_samples, sampling_params):
        right = self._answer(tiny_tokenizer().decode(prompt.to_ints()))
        answers = [right] if sampling_params.top_k == 1 else [right] + ["banana"] * (num_samples - 1)
        stop = list(self.renderer.get_stop_sequences())
        sequences = []
        for answer in answers:
            tokens = tiny_tokenizer().encode(answer, add_special_tokens=False) + stop
            sequences.append(SimpleNamespace(tokens=tokens, logprobs=[-1.0] * len(tokens), stop_reason="stop"))
        return SimpleNamespace(result=lambda: SimpleNamespace(sequences=sequences))


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_each_env_kind_trains_on_its_table_rows_and_is_evaluated_on_the_held_out_ones(kind, renderer, hub_mirror):
    table = load_problems(ProblemSourceConfig(**{"heldout_fraction": 0.25, **SOURCES[kind]})).table
    assert unverified_answers(table) == []
    train, heldout = (rl_problems_from_table(table, split) for split in ("train", "heldout"))
    assert train and heldout and not {p.row_id for p in train} & {p.row_id for p in heldout}

    dataset = build_rl_dataset("problems", renderer, group_size=2, groups_per_batch=1, table=table)
    builders = [builder for index in range(len(dataset)) for builder in dataset.get_batch(index)]
    expected = GuessNumberGroupBuilder if kind == "guess_number" else ProblemGroupBuilder
    assert builders and all(isinstance(builder, expected) for builder in builders)
    trained = {builder.secret if kind == "guess_number" else builder.problem.row_id for builder in builders}
    assert trained <= {int(p.answer) if kind == "guess_number" else p.row_id for p in train}

    player = OraclePlayer(renderer, {p.question: p.answer for p in heldout})
    scores = EnvEvaluator(renderer, heldout, k=2, max_tokens=16).score_items(EvalTarget(sampling_client=player))
    assert set(scores) == {"reward", "accuracy", "pass@1", "pass@2"}
    assert len(scores["accuracy"]) == len(heldout)  # one item per held-out row, secrets sharing a prompt included
    assert all(value == 1.0 for value in scores["accuracy"].values()), scores["accuracy"]
    assert all(value == 1.0 for value in scores["reward"].values())
    assert all(v == 1.0 for v in scores["pass@2"].values())
    # one of two samples is right; a game's wrong first guess is told to retry, and the player then plays well
    assert all(v == (1.0 if kind == "guess_number" else 0.5) for v in scores["pass@1"].values())


def test_generated_instances_are_stable_and_split_by_instance():
    rows = generate_rows("guess_number?count=60&seed=1", 0.3)
    assert rows == generate_rows("guess_number?count=60&seed=1", 0.3)
    assert {row["split"] for row in rows} == {"train", "heldout"} and all(row["scorer"] == GUESS_NUMBER_SCORER for row in rows)
    by_secret = {}
    for row in rows:
        assert by_secret.setdefault(row["answer"], row["split"]) == row["split"]  # a secret is never on both sides
    arithmetic = generate_rows("arithmetic?count=100", 0.1)
    assert len({row["question"] for row in arithmetic}) == 100
    for bad, message in (("guess_number?colour=3", "not one of"), ("arithmetic?count=x", "integer"), ("arithmetic?count=20000", "exceeds")):
        with pytest.raises(ValueError, match=message):
            generate_rows(bad, 0.1)


def test_an_unplayable_instance_fails_the_blocking_check():
    table = load_problems(ProblemSourceConfig(source="guess_number?count=5&high=10")).table
    broken = table.set_column(table.schema.get_field_index("answer"), "answer", pa.array(["99"] * table.num_rows))
    assert any("outside [1, 10]" in failure for failure in unverified_answers(broken))
