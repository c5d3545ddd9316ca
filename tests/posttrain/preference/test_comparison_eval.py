"""Win rate ± s.e. of a policy over a reference, and a preference model's held-out accuracy, by hand."""

import math

import pytest

from posttrain.datasets.problems import RLProblem
from posttrain.completers import MessageCompleter, SamplingSettings, TokenCompleter
from posttrain.preference.comparison_eval import PreferenceAccuracyEvaluator, accuracy_metrics, comparison_metrics
from posttrain.preference.comparison_format import Comparison, ComparisonRenderer
from posttrain.preference.env import PreferencePrompt
from posttrain.preference.preference_model import LabelProbabilities, combine_orders
from posttrain.renderers import get_renderer
from tests.posttrain.preference.judges import ShorterIsBetter
from tests.posttrain.preference.tiny_pairs import TINY_MODEL, tiny_tokenizer


def problem(row_id: str, answer: str) -> RLProblem:
    return RLProblem(row_id, "heldout", "sum", f"What is {answer}?", answer, "exact_number", "{}")


def test_win_rate_and_its_standard_error_match_a_hand_computation():
    prompts = [PreferencePrompt(f"p{i}", [{"role": "user", "content": f"q{i}"}], problem(f"p{i}", "12")) for i in range(4)]
    mine = ["12", "The answer is 12", "12", "99"]
    theirs = ["The sum is 12", "12", "12", "100"]
    metrics = comparison_metrics(prompts, mine, theirs, ShorterIsBetter())
    # shorter wins: win, loss, tie, win -> scores 1, 0, ½, 1
    scores = [1.0, 0.0, 0.5, 1.0]
    mean = sum(scores) / 4
    stderr = math.sqrt(sum((s - mean) ** 2 for s in scores) / 3 / 4)
    assert metrics["win_rate"] == pytest.approx(mean) and metrics["win_rate_stderr"] == pytest.approx(stderr)
    assert metrics["win_rate_n"] == 4.0
    assert metrics["verdict_win_rate"] == pytest.approx(mean)  # a sure judge: its verdicts are its probabilities
    assert metrics["judge_position_bias"] == 0.0
    # the verifier: mine 3/4 correct, theirs 3/4; per prompt differences 0, 0, 0, 0
    assert metrics["accuracy"] == 0.75 and metrics["opponent_accuracy"] == 0.75
    assert metrics["accuracy_stderr"] == pytest.approx(math.sqrt(0.75 * 0.25 / 3))
    assert (metrics["accuracy_delta"], metrics["accuracy_delta_stderr"]) == (0.0, 0.0)


def test_the_win_on_prompts_the_verifier_calls_even_is_reported_apart():
    prompts = [PreferencePrompt(f"p{i}", [{"role": "user", "content": f"q{i}"}], problem(f"p{i}", "12")) for i in range(3)]
    mine = ["12", "The answer is 12", "12"]
    theirs = ["13", "12", "The sum is 13"]  # graded wrong, right, wrong: only p1 is even
    metrics = comparison_metrics(prompts, mine, theirs, ShorterIsBetter())
    assert metrics["win_rate"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)  # equal length ties; shorter wins
    assert metrics["win_rate_verifier_tied"] == 0.0 and metrics["win_rate_verifier_tied_n"] == 1.0
    assert "win_rate_verifier_tied" not in comparison_metrics(prompts[:1], ["12"], ["13"], ShorterIsBetter())


def test_a_position_biased_judge_shows_its_bias():
    prompts = [PreferencePrompt("p", [{"role": "user", "content": "q"}])]
    metrics = comparison_metrics(prompts, ["aa"], ["a"], ShorterIsBetter(bias=0.3))
    # forward: the second ("a") is better, P = 1.0 (+0.3, clipped): s_f = 1.0; swapped: the second ("aa")
    # gets 0.0 + 0.3: s_s = 0.3 - 0.7 = -0.4. score = (1.0 + 0.4) / 2 = 0.7, so "aa" wins (1 - 0.7) / 2.
    assert metrics["win_rate"] == pytest.approx(0.15)
    assert metrics["verdict_win_rate"] == 0.0  # "a" is the most probable label's pick in both orders
    assert metrics["judge_position_bias"] == pytest.approx((1.0 - 0.4) / 2)
    assert "accuracy" not in metrics  # no verifier


def test_verdict_wins_count_the_label_each_order_would_pick():
    unsure_right = combine_orders(LabelProbabilities(0.6, 0.4, 0.0), LabelProbabilities(0.3, 0.7, 0.0))
    split = combine_orders(LabelProbabilities(0.9, 0.1, 0.0), LabelProbabilities(0.9, 0.1, 0.0))  # "first" twice
    tie_then_loss = combine_orders(LabelProbabilities(0.3, 0.3, 0.4), LabelProbabilities(0.8, 0.2, 0.0))
    one_order = combine_orders(LabelProbabilities(0.45, 0.55, 0.0), None)
    assert unsure_right.first_wins == pytest.approx(0.65) and unsure_right.first_wins_by_verdicts == 1.0
    assert split.first_wins == pytest.approx(0.5) and split.first_wins_by_verdicts == 0.5
    assert tie_then_loss.first_wins_by_verdicts == pytest.approx((0.5 + 0.0) / 2)
    assert one_order.first_wins_by_verdicts == 0.0
    equal = combine_orders(LabelProbabilities(0.5, 0.5, 0.0), LabelProbabilities(0.5, 0.5, 0.0))
    assert equal.first_wins_by_verdicts == 0.5  # A and B as likely: no preference, a tie


def test_preference_accuracy_counts_the_chosen_preferred_in_both_orders():
    right = combine_orders(LabelProbabilities(0.9, 0.1, 0.0), LabelProbabilities(0.2, 0.8, 0.0))
    biased = combine_orders(LabelProbabilities(0.3, 0.7, 0.0), LabelProbabilities(0.1, 0.9, 0.0))  # says "second" twice
    wrong = combine_orders(LabelProbabilities(0.2, 0.8, 0.0), LabelProbabilities(0.7, 0.3, 0.0))
    metrics = accuracy_metrics([right, biased, wrong])
    # chosen wins, both orders averaged: right (1 + 0.7) / 2, biased (1 + 0.2) / 2, wrong (1 - 0.5) / 2
    assert metrics["comparison_accuracy"] == pytest.approx(2 / 3)
    assert metrics["accuracy_chosen_first"] == pytest.approx(1 / 3)
    assert metrics["accuracy_chosen_second"] == pytest.approx(2 / 3)
    assert metrics["orders_agree"] == pytest.approx(2 / 3)
    assert metrics["position_bias"] == pytest.approx(((-0.8 + 0.6) / 2 + (0.4 + 0.8) / 2 + (0.6 - 0.4) / 2) / 3)
    assert metrics["comparison_accuracy_n"] == 3.0


class Target:
    def __init__(self, client):
        self.client = client

    def sampling_client(self):
        return self.client


def test_a_judge_that_answers_first_is_scored_with_its_own_answers_and_says_how_often_it_wrote_the_chosen_one(service_client):
    training_client = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=0).result()
    client = training_client.save_weights_and_get_sampling_client().result()
    renderer = ComparisonRenderer(get_renderer("chatml", tiny_tokenizer()))
    p, q = [{"role": "user", "content": "What is 3 + 4?"}], [{"role": "user", "content": "What is 5 + 1?"}]
    own = MessageCompleter(TokenCompleter(client, SamplingSettings(max_tokens=8, top_k=1)), renderer.renderer).complete(p, seed=0).text
    said = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    comparisons = [Comparison(p, said(own), said(own + "!")), Comparison(q, said(own + "?"), said("6"))]  # chosen first
    items = PreferenceAccuracyEvaluator(comparisons, renderer, prefix="", answers_first=True, answer_max_tokens=8).score_items(Target(client))
    assert sorted(items["own_answer_is_chosen"].values()) == [0.0, 1.0]
    assert len(items["comparison_accuracy"]) == 2
    plain = PreferenceAccuracyEvaluator(comparisons, renderer, prefix="").score_items(Target(client))
    assert "own_answer_is_chosen" not in plain
