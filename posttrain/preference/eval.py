"""Evaluating preference training: held-out pair accuracy, and a verifier-judged win rate of A over B.

- :class:`PairAccuracyEvaluator` (an ``posttrain.eval.base.Evaluator``): on held-out pairs, does the
  policy's implicit reward ``β·(lp − ref)`` rank chosen above rejected? It scores the policy with
  ``posttrain.eval.nll.target_logprobs`` (a training client's ``forward`` mid-run, or
  ``compute_logprobs`` of a saved checkpoint) and reads the reference sums from a
  ``REFERENCE_LOGPROBS`` table computed once, before training, for the held-out pairs.
- :func:`compare_policies`: both policies answer each held-out problem greedily; the task's verifier
  grades them; per prompt A wins (1) when A is correct and B is not, loses (0) in the reverse case, and
  ties (½) otherwise. The win rate is the mean, with its standard error ``sd / √n``. The verifier grades
  each answer alone, so the order of A and B cannot bias it and one pass suffices.
  :class:`WinRateEvaluator` is the same comparison as an ``Evaluator`` against a fixed opponent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import torch

from posttrain.eval.accuracy import AccuracyResult, ChatRenderer, TaskProblem, evaluate_accuracy, problem_keys
from posttrain.eval.base import EvalTarget
from posttrain.eval.nll import target_logprobs
from posttrain.preference.data import Pair
from posttrain.preference.dpo import dpo_loss, pair_credit
from posttrain.preference.reference import ReferenceSums


class PairAccuracyEvaluator:
    """``{prefix}pair_accuracy``, ``{prefix}dpo_loss``, ``{prefix}margin`` on held-out pairs."""

    def __init__(self, pairs: Sequence[Pair], reference: pa.Table | Callable[[], pa.Table], beta: float, prefix: str = "eval/"):
        """``reference``: the table, or a function returning it at the first evaluation (a recipe computes
        it only when training starts)."""
        if not pairs:
            raise ValueError("PairAccuracyEvaluator got no pairs: pass the held-out pairs (pairs_from_table(table, 'heldout'))")
        self.pairs = list(pairs)
        self._reference_source = reference
        self.reference: ReferenceSums | None = None
        self.beta = beta
        self.prefix = prefix
        if isinstance(reference, pa.Table):
            self._load_reference()

    def _load_reference(self) -> ReferenceSums:
        if self.reference is None:
            source = self._reference_source
            self.reference = ReferenceSums.from_table(source if isinstance(source, pa.Table) else source())
            self.reference.check_covers([pair.row_id for pair in self.pairs])
        return self.reference

    def _policy_sums(self, target: EvalTarget) -> tuple[list[float], list[float]]:
        data = [datum for pair in self.pairs for datum in (pair.chosen.datum(), pair.rejected.datum())]
        scored = target_logprobs(target, data)
        sums = [
            float(np.dot(logprobs, np.asarray(side.weights, dtype=np.float64)))
            for logprobs, side in zip(scored, (side for pair in self.pairs for side in (pair.chosen, pair.rejected)))
        ]
        return sums[0::2], sums[1::2]

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        reference = self._load_reference()
        chosen, rejected = self._policy_sums(target)
        chosen_ref, rejected_ref = reference.for_rows([pair.row_id for pair in self.pairs])
        _, metrics = dpo_loss(
            torch.tensor(chosen, dtype=torch.float64), torch.tensor(rejected, dtype=torch.float64),
            torch.tensor(chosen_ref, dtype=torch.float64), torch.tensor(rejected_ref, dtype=torch.float64), self.beta,
        )
        return {
            f"{self.prefix}pair_accuracy": metrics["accuracy"],
            f"{self.prefix}dpo_loss": metrics["dpo_loss"],
            f"{self.prefix}margin": metrics["margin"],
            f"{self.prefix}num_pairs": float(len(self.pairs)),
        }

    def score_items(self, target: EvalTarget) -> dict[str, dict[str, float]]:
        """Per held-out pair (keyed by its row id), under the DPO implicit reward r = β·(lp − lp_ref):
        ``pair_accuracy`` (1 if r_chosen > r_rejected beyond a tie, ½ for a tie), ``margin`` (r_chosen − r_rejected) and ``dpo_loss``."""
        reference = self._load_reference()
        chosen, rejected = self._policy_sums(target)
        chosen_ref, rejected_ref = reference.for_rows([pair.row_id for pair in self.pairs])
        margins = [self.beta * ((c - cr) - (r - rr)) for c, r, cr, rr in zip(chosen, rejected, chosen_ref, rejected_ref)]
        keys = [pair.row_id for pair in self.pairs]  # pairs carry tokens, not prompt text; row ids are stable per version
        credit = pair_credit(torch.tensor(margins, dtype=torch.float64), self.beta).tolist()
        return {
            f"{self.prefix}pair_accuracy": dict(zip(keys, credit)),
            f"{self.prefix}margin": dict(zip(keys, margins)),
            f"{self.prefix}dpo_loss": {k: float(np.logaddexp(0.0, -m)) for k, m in zip(keys, margins)},
        }


@dataclass
class WinRate:
    win_rate: float  # ties count ½
    stderr: float
    wins: int
    losses: int
    ties: int
    accuracy_a: float
    accuracy_b: float
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def num_prompts(self) -> int:
        return self.wins + self.losses + self.ties

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        return {
            f"{prefix}win_rate": self.win_rate,
            f"{prefix}win_rate_se": self.stderr,
            f"{prefix}wins": float(self.wins),
            f"{prefix}losses": float(self.losses),
            f"{prefix}ties": float(self.ties),
            f"{prefix}accuracy_a": self.accuracy_a,
            f"{prefix}accuracy_b": self.accuracy_b,
        }


def win_rate_from_outcomes(a_correct: Sequence[bool], b_correct: Sequence[bool]) -> tuple[float, float, list[float]]:
    """(win rate, its standard error, per-prompt scores 1 / ½ / 0) from paired verdicts."""
    if len(a_correct) != len(b_correct) or not a_correct:
        raise ValueError(f"need the same, positive number of verdicts for A and B, got {len(a_correct)} and {len(b_correct)}")
    scores = [1.0 if a and not b else 0.0 if b and not a else 0.5 for a, b in zip(a_correct, b_correct)]
    count = len(scores)
    mean = sum(scores) / count
    stderr = math.sqrt(sum((s - mean) ** 2 for s in scores) / (count - 1) / count) if count > 1 else 0.0
    return mean, stderr, scores


def compare_policies(
    target_a: EvalTarget,
    target_b: EvalTarget,
    renderer: ChatRenderer,
    problems: Sequence[TaskProblem],
    *,
    max_tokens: int = 64,
) -> WinRate:
    """Win rate of A over B on ``problems``, both answering greedily, judged by each problem's verifier."""
    graded = [evaluate_accuracy(target, renderer, problems, max_tokens=max_tokens, top_k=1) for target in (target_a, target_b)]
    return win_rate_of(*graded)


def win_rate_of(graded_a: AccuracyResult, graded_b: AccuracyResult) -> WinRate:
    """The win rate of A over B from both policies' verdicts on the same problems, in the same order."""
    a_rows, b_rows = graded_a.rows, graded_b.rows
    if [row.row_id for row in a_rows] != [row.row_id for row in b_rows]:
        raise ValueError("win_rate_of needs both policies graded on the same problems in the same order (one sample each)")
    rate, stderr, scores = win_rate_from_outcomes([r.correct for r in a_rows], [r.correct for r in b_rows])
    rows = [
        {"row_id": a.row_id, "question": a.question, "response_a": a.response, "response_b": b.response,
         "correct_a": a.correct, "correct_b": b.correct, "score": score}
        for a, b, score in zip(a_rows, b_rows, scores)
    ]
    return WinRate(
        win_rate=rate, stderr=stderr,
        wins=sum(s == 1.0 for s in scores), losses=sum(s == 0.0 for s in scores), ties=sum(s == 0.5 for s in scores),
        accuracy_a=graded_a.accuracy, accuracy_b=graded_b.accuracy, rows=rows,
    )


class WinRateEvaluator:
    """``{prefix}accuracy``, ``{prefix}win_rate`` and ``{prefix}win_rate_se`` of a target over a fixed opponent.

    Greedy answers to held-out problems, each graded alone by its verifier (:func:`compare_policies`).
    The opponent (e.g. the checkpoint's parent) is sampled once, at the first call, and its verdicts are
    reused for every target an eval report scores (checkpoint, base, parent); the target's own greedy
    accuracy comes with it, so the problems are not sampled twice.
    """

    def __init__(
        self,
        renderer: ChatRenderer,
        problems: Sequence[TaskProblem],
        opponent: Callable[[], EvalTarget],
        *,
        max_tokens: int = 64,
        seed: int = 0,
        prefix: str = "",
    ):
        if not problems:
            raise ValueError("WinRateEvaluator got no problems: pass the held-out problems (problems_from_table(table, 'heldout'))")
        self.renderer = renderer
        self.problems = list(problems)
        self.opponent = opponent
        self.sampling = {"max_tokens": max_tokens, "top_k": 1, "seed": seed}
        self.prefix = prefix
        self._opponent_grades: AccuracyResult | None = None

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        if self._opponent_grades is None:
            self._opponent_grades = evaluate_accuracy(self.opponent(), self.renderer, self.problems, **self.sampling)
        result = win_rate_of(evaluate_accuracy(target, self.renderer, self.problems, **self.sampling), self._opponent_grades)
        return {
            f"{self.prefix}accuracy": result.accuracy_a,
            f"{self.prefix}win_rate": result.win_rate,
            f"{self.prefix}win_rate_se": result.stderr,
        }

    def score_items(self, target: EvalTarget) -> dict[str, dict[str, float]]:
        """Per problem (keyed by its prompt's hash): the target's greedy correctness and its win (1 / ½ / 0)."""
        if self._opponent_grades is None:
            self._opponent_grades = evaluate_accuracy(self.opponent(), self.renderer, self.problems, **self.sampling)
        result = win_rate_of(evaluate_accuracy(target, self.renderer, self.problems, **self.sampling), self._opponent_grades)
        keys = problem_keys(self.problems)
        return {
            f"{self.prefix}accuracy": {k: float(row["correct_a"]) for k, row in zip(keys, result.rows)},
            f"{self.prefix}win_rate": {k: row["score"] for k, row in zip(keys, result.rows)},
        }
