"""Scoring a pair with the label tokens' probabilities, both orders averaged."""

import math

import numpy as np
import pytest

from posttrain.completers import MessageCompleter, SamplingSettings, TokenCompleter
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


class CountingSampler:
    """A real sampling client that records the prompts it is asked to sample from."""

    def __init__(self, client):
        self.client = client
        self.sampled: list[list[int]] = []

    def sample(self, prompt, num_samples, params):
        self.sampled.append(prompt.to_ints())
        return self.client.sample(prompt, num_samples, params)

    def compute_logprobs(self, *args, **kwargs):
        return self.client.compute_logprobs(*args, **kwargs)


def test_a_judge_that_answers_first_judges_with_its_own_greedy_answer_once_per_prompt(service_client):
    training_client = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=0).result()
    sampler = CountingSampler(training_client.save_weights_and_get_sampling_client().result())
    renderer = ComparisonRenderer(get_renderer("chatml", tiny_tokenizer()))
    p, q = [{"role": "user", "content": "What is 3 + 4?"}], [{"role": "user", "content": "What is 5 + 1?"}]
    said = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    comparisons = [Comparison(p, said("7"), said("9")), Comparison(p, said("8"), said("7")), Comparison(q, said("6"), said("5")),
                   Comparison(q, said("6"), said("6"))]
    judge = PreferenceModel(sampler, renderer, answers_first=True, answer_max_tokens=8)
    verdicts = judge.judge(comparisons)
    assert len(sampler.sampled) == 2  # one answer per prompt; the identical pair needs none
    greedy = MessageCompleter(TokenCompleter(sampler.client, SamplingSettings(max_tokens=8, top_k=1)), renderer.renderer)
    own = greedy.complete(p, seed=0).text
    assert judge.own_answer(p) == own and judge.own_answer(q) == greedy.complete(q, seed=0).text
    # the verdict is exactly the plain judge's on the comparison with that answer as its reference
    (expected,) = PreferenceModel(sampler.client, renderer).judge([comparisons[0].with_reference(said(own))])
    assert (verdicts[0].forward, verdicts[0].swapped) == (expected.forward, expected.swapped)
    (without,) = PreferenceModel(sampler.client, renderer).judge([comparisons[0]])
    assert without.forward != expected.forward  # the reference is read: the prompt the labels follow differs
    assert verdicts[3].identical
    judge.judge(comparisons[:1])
    given = judge.judge([comparisons[2].with_reference(said("six"))])
    assert len(sampler.sampled) == 2  # answers are cached, and a comparison that brings its own reference keeps it
    (explicit,) = PreferenceModel(sampler.client, renderer).judge([comparisons[2].with_reference(said("six"))])
    assert given[0].forward == explicit.forward


def test_another_sampler_can_write_the_answers_a_judge_reads(service_client):
    training_client = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=0).result()
    client = training_client.save_weights_and_get_sampling_client().result()
    judge_client, answerer = CountingSampler(client), CountingSampler(client)
    renderer = ComparisonRenderer(get_renderer("chatml", tiny_tokenizer()))
    prompt = [{"role": "user", "content": "What is 3 + 4?"}]
    judge = PreferenceModel(judge_client, renderer, answers_first=True, answer_max_tokens=8, answerer=answerer)
    judge.judge([Comparison(prompt, [{"role": "assistant", "content": "7"}], [{"role": "assistant", "content": "9"}])])
    assert (len(answerer.sampled), len(judge_client.sampled)) == (1, 0)
    assert judge.own_answer(prompt) is not None
