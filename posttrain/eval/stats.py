"""Means with their standard errors, and paired comparisons, for every reported metric.

One place for the statistics every eval report, benchmark and win rate states (ARCHITECTURE §10):
a mean always travels with n and its standard error, and a checkpoint is compared with its parent
*paired* on the same held-out items, so the noise shared by both (which items are hard) cancels.
The binomial standard error uses n − 1, as inspect-ai reports it, so our figures and inspect's agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

SIGNIFICANCE_SE = 2.0
"""A difference counts as real when it exceeds this many standard errors (≈95% two-sided)."""


@dataclass(frozen=True)
class Estimate:
    """A mean over n items and its standard error (NaN s.e. when n < 2)."""

    value: float
    stderr: float
    n: int

    def as_dict(self, name: str) -> dict[str, float]:
        """``{name, name_stderr, name_n}``: the flat form eval reports and MLflow metrics use."""
        return {name: self.value, f"{name}_stderr": self.stderr, f"{name}_n": float(self.n)}


@dataclass(frozen=True)
class PairedDifference:
    """checkpoint − parent over the items both scored, with the s.e. of the per-item difference."""

    delta: float
    stderr: float
    n: int

    @property
    def significant(self) -> bool:
        """True when |delta| exceeds :data:`SIGNIFICANCE_SE` standard errors (False when undefined)."""
        if self.n < 2 or math.isnan(self.stderr):
            return False
        if self.stderr == 0.0:
            return self.delta != 0.0
        return abs(self.delta) > SIGNIFICANCE_SE * self.stderr


def _values(scores: Sequence[float], what: str) -> list[float]:
    values = [float(s) for s in scores]
    if not values:
        raise ValueError(f"{what}: no scores to average; score at least one item")
    bad = [i for i, v in enumerate(values) if math.isnan(v)]
    if bad:
        raise ValueError(f"{what}: item(s) {bad[:5]} scored NaN; drop or fix them before averaging")
    return values


def mean_estimate(scores: Sequence[float]) -> Estimate:
    """Sample mean and its standard error s/√n (sample s.d. with n − 1); for 0/1 scores this is
    √(p(1−p)/(n−1)), the binomial s.e. inspect-ai reports."""
    values = _values(scores, "mean_estimate")
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return Estimate(mean, float("nan"), n)
    variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return Estimate(mean, math.sqrt(variance / n), n)


def binomial_estimate(successes: int, n: int) -> Estimate:
    """A proportion from counts: p = k/n with s.e. √(p(1−p)/(n−1)) (equal to :func:`mean_estimate` of 0/1 scores)."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"binomial_estimate: need 0 <= successes ({successes}) <= n ({n}) and n > 0")
    p = successes / n
    stderr = math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")
    return Estimate(p, stderr, n)


def paired_difference(
    checkpoint: Mapping[str, float], parent: Mapping[str, float]
) -> PairedDifference:
    """Mean of checkpoint[item] − parent[item] over the items both scored, with its standard error.

    Items are keyed (a held-out prompt's hash, a benchmark sample id) so the pairing survives order
    changes; items only one side scored are left out, and no common item is an error."""
    common = sorted(set(checkpoint) & set(parent))
    if not common:
        raise ValueError(
            "paired_difference: the checkpoint and its parent share no scored item; "
            "evaluate both on the same held-out items"
        )
    estimate = mean_estimate([checkpoint[k] - parent[k] for k in common])
    return PairedDifference(estimate.value, estimate.stderr, estimate.n)
