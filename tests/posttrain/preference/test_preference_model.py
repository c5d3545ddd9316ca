"""Scoring a pair with the label tokens' probabilities, both orders averaged."""

import math

import numpy as np
import pytest

from posttrain.preference.comparison_format import Comparison, ComparisonRenderer
from posttrain.preference.preference_model import LabelProbabilities, PreferenceModel, combine_orders
from posttrain.renderers import get_renderer
from tests.posttrain.preference.tiny_pairs import TINY_MODEL, tiny_tokenizer


def test_label_probabilities_are_normalised_over_the_labels():
    probs = LabelProbabilities.from_logprobs({"A": math.log(0.2), "B": math.log(0.1), "Tie": math.log(0.1)})
    assert (probs.first, probs.second, probs.tie) == pytest.approx((0.5, 0.25, 0.25))
    assert probs.score == pytest.approx(-0.25) and probs.verdict == "A"


def test_both_orders_cancel_a_position_bias_and_measure_it():
    # A model that adds +0.2 to whatever is second, on a pair where B is truly better by 0.4:
    forward = LabelProbabilities(first=0.2, second=0.8, tie=0.0)  # s_f = 0.6 = 0.4 + 0.2
    swapped = LabelProbabilities(first=0.6, second=0.4, tie=0.0)  # s_s = -0.2 = -0.4 + 0.2
    verdict = combine_orders(forward, swapped)
    assert verdict.score == pytest.approx(0.4)
    assert verdict.position_bias == pytest.approx(0.2)
    assert verdict.orders_agree is True  # B in the forward order, B (shown first) in the swapped one
    assert verdict.second_wins == pytest.approx(0.7) and verdict.first_wins == pytest.approx(0.3)
    # A model that always answers "second": the orders disagree, the score cancels to 0, the bias is 1
    always_second = combine_orders(LabelProbabilities(0.0, 1.0, 0.0), LabelProbabilities(0.0, 1.0, 0.0))
    assert (always_second.score, always_second.position_bias, always_second.orders_agree) == (0.0, 1.0, False)
    one = combine_orders(forward, None)
    assert one.score == pytest.approx(0.6) and math.isnan(one.position_bias) and one.orders_agree is None


def test_a_real_model_scores_with_its_label_token_probabilities(service_client):
    training_client = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=0).result()
    sampler = training_client.save_weights_and_get_sampling_client().result()
    renderer = ComparisonRenderer(get_renderer("chatml", tiny_tokenizer()))
    comparison = Comparison(
        [{"role": "user", "content": "What is 3 + 4?"}], [{"role": "assistant", "content": "7"}], [{"role": "assistant", "content": "9 maybe"}]
    )
    verdict, same = PreferenceModel(sampler, renderer).judge([comparison, Comparison(comparison.prompt, comparison.completion_a, comparison.completion_a)])
    scoring = renderer.scoring_input(comparison)
    expected = {label: sampler.compute_logprobs(scoring.sequence(label)).result()[-1] for label in ("A", "B", "Tie")}
    probs = np.exp(np.asarray(list(expected.values())))
    probs /= probs.sum()
    assert (verdict.forward.first, verdict.forward.second, verdict.forward.tie) == pytest.approx(tuple(probs), abs=1e-5)
    assert verdict.forward.first + verdict.forward.second + verdict.forward.tie == pytest.approx(1.0)
    assert same.identical and same.score == 0.0 and same.second_wins == 0.5  # identical completions: a tie, not judged
    assert not verdict.identical
    one_way = PreferenceModel(sampler, renderer, orders="one").judge([comparison])[0]
    assert one_way.swapped is None and one_way.score == pytest.approx(verdict.forward.score, abs=1e-6)


class NoSampler:
    def compute_logprobs(self, *args, **kwargs):
        raise AssertionError("identical completions must not be sent to the preference model")


@pytest.mark.parametrize("orders", ["both", "one"])
def test_identical_completions_tie_without_a_request_in_either_order_mode(orders):
    renderer = ComparisonRenderer(get_renderer("chatml", tiny_tokenizer()))
    answer = [{"role": "assistant", "content": "7"}]
    (verdict,) = PreferenceModel(NoSampler(), renderer, orders=orders).judge([Comparison([{"role": "user", "content": "3 + 4?"}], answer, list(answer))])
    assert verdict.identical and verdict.first_wins == verdict.second_wins == 0.5
    assert math.isnan(verdict.position_bias) and verdict.orders_agree is None and verdict.swapped is None
