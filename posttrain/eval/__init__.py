"""Evaluators shared by every recipe: held-out NLL / bits per byte, and sampled task accuracy.

Each evaluator is a callable ``(EvalTarget) -> dict[str, float]`` usable inside a training loop
(``train_supervised(evaluators=[...])``) or on a saved checkpoint / base model
(``EvalTarget.from_checkpoint(service_client, sampler_path)``). The ``evaluate_*`` functions return the
full results (per-example rows) for eval reports.
"""

from posttrain.eval.accuracy import AccuracyEvaluator, AccuracyResult, SampleGrade, TaskProblem, evaluate_accuracy, problems_from_table
from posttrain.eval.answers import extract_answer
from posttrain.eval.base import EvalTarget, Evaluator, run_evaluators
from posttrain.eval.math_answers import grade_math, same_value
from posttrain.eval.nll import NllEvaluator, NllResult, evaluate_nll

__all__ = [
    "AccuracyEvaluator",
    "AccuracyResult",
    "EvalTarget",
    "Evaluator",
    "NllEvaluator",
    "NllResult",
    "SampleGrade",
    "TaskProblem",
    "evaluate_accuracy",
    "evaluate_nll",
    "extract_answer",
    "grade_math",
    "problems_from_table",
    "run_evaluators",
    "same_value",
]
