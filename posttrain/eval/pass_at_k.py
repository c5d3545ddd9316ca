"""pass@k: the chance that at least one of k samples solves a problem, estimated without bias.

Drawing exactly k samples and checking "any correct" is unbiased but noisy; with n ≥ k samples per
problem of which c are correct, 1 − C(n−c, k)/C(n, k) is the unbiased estimator of Chen et al. (2021)
(HumanEval), averaged over problems. Samples are drawn at temperature 1 with no top-k cut-off: pass@k
measures what the policy *can* find, greedy accuracy (:mod:`posttrain.eval.accuracy`) what it finds first.
"""

from __future__ import annotations

from math import comb
from typing import Any, Sequence

from posttrain.completers import ChatRenderer
from posttrain.eval.accuracy import TaskProblem, evaluate_accuracy, per_problem, problem_keys
from posttrain.eval.base import EvalTarget
from posttrain.eval.items import mean_metrics


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 − C(n−c, k)/C(n, k) (Chen et al., 2021)."""
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"pass_at_k: num_correct={num_correct} must be in [0, num_samples={num_samples}]")
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass_at_k: k={k} must be in [1, num_samples={num_samples}]")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - comb(num_samples - num_correct, k) / comb(num_samples, k)


class PassAtKEvaluator:
    """An :class:`~posttrain.eval.base.Evaluator` reporting ``{prefix}pass@1`` and ``{prefix}pass@{k}``.

    ``num_samples`` (n, default k) samples per problem at ``temperature``; pass@1 = mean c/n is the
    sampled (not greedy) accuracy. ``renderer`` may be a renderer name, built over the target's tokenizer.
    """

    def __init__(
        self,
        renderer: ChatRenderer | str,
        problems: Sequence[TaskProblem],
        k: int,
        *,
        num_samples: int | None = None,
        prefix: str = "",
        temperature: float = 1.0,
        **sampling: Any,
    ):
        num_samples = k if num_samples is None else num_samples
        if not 1 <= k <= num_samples:
            raise ValueError(f"PassAtKEvaluator: k={k} must be in [1, num_samples={num_samples}]; draw at least k samples per problem")
        if not problems:
            raise ValueError("PassAtKEvaluator got no problems: pass at least one TaskProblem")
        self.renderer = renderer
        self.problems = list(problems)
        self.k = k
        self.num_samples = num_samples
        self.prefix = prefix
        self.sampling = {"temperature": temperature, "top_k": -1, **sampling}

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        return mean_metrics(self.score_items(target))

    def score_items(self, target: EvalTarget) -> dict[str, dict[str, float]]:
        """Per problem (keyed by its prompt's hash): c/n as ``pass@1`` and the unbiased ``pass@k``."""
        if isinstance(self.renderer, str):
            from posttrain.renderers import get_renderer

            self.renderer = get_renderer(self.renderer, target.tokenizer())
        result = evaluate_accuracy(target, self.renderer, self.problems, num_samples=self.num_samples, **self.sampling)
        n = self.num_samples
        correct_P = [sum(row.correct for row in rows) for rows in per_problem(result.rows, len(self.problems))]
        keys = problem_keys(self.problems)
        scores = {f"{self.prefix}pass@1": {key: c / n for key, c in zip(keys, correct_P)}}
        if self.k > 1:
            scores[f"{self.prefix}pass@{self.k}"] = {key: pass_at_k(n, c, self.k) for key, c in zip(keys, correct_P)}
        return scores
