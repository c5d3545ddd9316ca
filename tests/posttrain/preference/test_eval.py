"""Held-out pair accuracy and the verifier-judged win rate."""

import math

import pytest

from posttrain.eval.accuracy import TaskProblem
from posttrain.eval.base import EvalTarget
from posttrain.preference.data import pairs_from_table
from posttrain.preference.eval import PairAccuracyEvaluator, compare_policies, win_rate_from_outcomes
from posttrain.preference.reference import compute_reference_logprobs, reference_sampling_client
from posttrain.renderers import get_renderer
from tests.posttrain.preference.tiny_pairs import TINY_MODEL, pairs_table, tiny_tokenizer


def test_win_rate_counts_ties_as_half_with_its_standard_error():
    rate, stderr, scores = win_rate_from_outcomes([True, True, False, False], [False, True, True, False])
    assert scores == [1.0, 0.5, 0.0, 0.5]
    assert rate == 0.5
    assert stderr == pytest.approx(math.sqrt((0.25 + 0 + 0.25 + 0) / 3 / 4))
    assert win_rate_from_outcomes([True] * 3, [False] * 3)[:2] == (1.0, 0.0)
    with pytest.raises(ValueError, match="same, positive number of verdicts"):
        win_rate_from_outcomes([True], [])


def test_pair_accuracy_at_init_is_a_tie_against_the_reference(service_client):
    pairs = pairs_from_table(pairs_table(3), split=None)
    training_client = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=0).result()
    reference = compute_reference_logprobs(reference_sampling_client(service_client, training_client=training_client), pairs)
    metrics = PairAccuracyEvaluator(pairs, reference, beta=0.1, prefix="heldout/")(EvalTarget(training_client=training_client))
    assert metrics["heldout/dpo_loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert metrics["heldout/margin"] == pytest.approx(0.0, abs=1e-3)
    assert metrics["heldout/pair_accuracy"] == 0.5  # margins are 0 up to float noise: ties, chance
    items = PairAccuracyEvaluator(pairs, reference, beta=0.1, prefix="heldout/").score_items(EvalTarget(training_client=training_client))
    assert set(items["heldout/pair_accuracy"].values()) == {0.5}  # per pair, as the report pairs them
    assert metrics["heldout/num_pairs"] == 3.0


def test_a_reference_for_other_pairs_is_refused(service_client):
    pairs = pairs_from_table(pairs_table(3), split=None)
    training_client = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=0).result()
    reference = compute_reference_logprobs(reference_sampling_client(service_client, training_client=training_client), pairs[:1])
    with pytest.raises(ValueError, match="miss 2 of 3 pairs"):
        PairAccuracyEvaluator(pairs, reference, beta=0.1)


def test_a_policy_against_itself_ties_on_every_prompt(service_client):
    training_client = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=0).result()
    sampler_path = training_client.save_weights_for_sampler("winrate-test").result().path
    problems = [TaskProblem(question=f"What is {i} + 2?", answer=str(i + 2), row_id=f"q{i}") for i in range(3)]
    result = compare_policies(
        EvalTarget.from_checkpoint(service_client, sampler_path), EvalTarget.from_checkpoint(service_client, sampler_path),
        get_renderer("chatml", tiny_tokenizer()), problems, max_tokens=6,
    )
    assert (result.win_rate, result.stderr, result.ties, result.num_prompts) == (0.5, 0.0, 3, 3)
    assert [row["response_a"] for row in result.rows] == [row["response_b"] for row in result.rows]  # greedy is deterministic
    assert result.metrics()["eval/win_rate"] == 0.5
