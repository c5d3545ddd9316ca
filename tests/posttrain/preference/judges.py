"""A rule-based stand-in for a trained preference model, for tests of what is built around one."""

from __future__ import annotations

from posttrain.preference.comparison_format import Comparison
from posttrain.preference.preference_model import LabelProbabilities, PairVerdict, combine_orders


class ShorterIsBetter:
    """Prefers the shorter completion surely; equal lengths tie. ``bias`` is added to the second's probability."""

    def __init__(self, bias: float = 0.0):
        self.bias = bias
        self.calls: list[Comparison] = []

    def _order(self, comparison: Comparison) -> LabelProbabilities:
        a, b = (len(c[0]["content"]) for c in (comparison.completion_a, comparison.completion_b))
        second = 1.0 if b < a else 0.0 if b > a else 0.5
        second = min(max(second + self.bias, 0.0), 1.0)
        return LabelProbabilities(first=1.0 - second, second=second, tie=0.0)

    def judge(self, comparisons: list[Comparison]) -> list[PairVerdict]:
        self.calls += comparisons
        return [combine_orders(self._order(c), self._order(c.swap())) for c in comparisons]
