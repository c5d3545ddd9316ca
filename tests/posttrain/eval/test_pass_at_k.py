"""pass@k: the unbiased estimator, and the evaluator on the tiny model against a per-problem recount."""

import pytest

from posttrain.eval.accuracy import AccuracyEvaluator, TaskProblem, evaluate_accuracy, problem_keys
from posttrain.eval.items import mean_metrics
from posttrain.eval.base import EvalTarget
from posttrain.eval.pass_at_k import PassAtKEvaluator, pass_at_k
from posttrain.renderers import get_renderer
from tests.fixtures.server import TINY_MODEL
from tests.posttrain.supervised.tiny_data import tiny_tokenizer


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
    assert pass_at_k(5, 4, 2) == 1.0  # fewer wrong samples than k
    assert pass_at_k(5, 0, 3) == 0.0
    for bad in ((5, 6, 1), (5, 2, 0), (5, 2, 6)):
        with pytest.raises(ValueError, match="pass_at_k"):
            pass_at_k(*bad)


def test_evaluator_needs_at_least_k_samples_and_a_problem():
    renderer = "chatml"
    with pytest.raises(ValueError, match="k=4 must be in"):
        PassAtKEvaluator(renderer, [TaskProblem("q", "1")], 4, num_samples=2)
    with pytest.raises(ValueError, match="no problems"):
        PassAtKEvaluator(renderer, [], 2)


def _grade_by_parity(extracted, problem):
    """A deterministic stand-in grade that is right about half the time on random text."""
    return float(len(extracted or "") % 2 == 0)


def test_evaluator_averages_the_estimator_over_problems(service_client):
    renderer = get_renderer("chatml", tiny_tokenizer())
    problems = [TaskProblem(f"What is {i} + 1?", str(i + 1), row_id=str(i)) for i in range(3)]
    target = EvalTarget(sampling_client=service_client.create_sampling_client(base_model=TINY_MODEL).result(), tokenizer=tiny_tokenizer())
    sampling = {"max_tokens": 6, "seed": 5, "grade": _grade_by_parity}
    metrics = PassAtKEvaluator(renderer, problems, 2, num_samples=4, **sampling)(target)

    recount = evaluate_accuracy(target, renderer, problems, num_samples=4, temperature=1.0, top_k=-1, **sampling)
    correct = [sum(row.correct for row in recount.rows if row.row_id == problem.row_id) for problem in problems]
    assert metrics == {
        "pass@1": pytest.approx(sum(correct) / 12),
        "pass@2": pytest.approx(sum(pass_at_k(4, c, 2) for c in correct) / 3),
    }
    assert metrics["pass@2"] >= metrics["pass@1"]


def test_item_scores_are_per_problem_and_average_to_the_reported_metrics(service_client):
    renderer = get_renderer("chatml", tiny_tokenizer())
    problems = [TaskProblem(f"What is {i} + 1?", str(i + 1), row_id=str(i)) for i in range(3)]
    target = EvalTarget(sampling_client=service_client.create_sampling_client(base_model=TINY_MODEL).result(), tokenizer=tiny_tokenizer())
    greedy = AccuracyEvaluator(renderer, problems, prefix="", format_coef=0.1, max_tokens=6, grade=_grade_by_parity)
    items = greedy.score_items(target)
    assert set(items) == {"accuracy", "well_formed", "reward"}
    assert list(items["accuracy"]) == problem_keys(problems) and len(set(problem_keys(problems))) == 3
    graded = evaluate_accuracy(target, renderer, problems, max_tokens=6, grade=_grade_by_parity).rows
    for key, row in zip(problem_keys(problems), graded):
        assert items["accuracy"][key] == float(row.correct)
        assert items["reward"][key] == pytest.approx(0.1 * (float(row.well_formed and row.extracted is not None) - 1) + row.score)
    sampled = PassAtKEvaluator(renderer, problems, 2, num_samples=4, max_tokens=6, seed=5, grade=_grade_by_parity)
    assert mean_metrics(sampled.score_items(target)) == pytest.approx(sampled(target))
