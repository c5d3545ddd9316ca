"""A trained preference model as a judge: which of two completions is better, and how sure it is.

:class:`PreferenceModel` scores a :class:`~posttrain.preference.comparison_format.Comparison` with the
probabilities of the label tokens (``A`` / ``B`` / ``Tie``) after the comparison's prompt, read with
``SamplingClient.compute_logprobs`` on prompt + label token (one request per label, all in flight at
once) and normalised over the labels. The cookbook samples one token at temperature 0 instead; the
probabilities give a graded verdict and make the position bias measurable.

Both orders (``orders="both"``, the default): the comparison is also judged with A and B swapped, and
the two verdicts are averaged, which cancels a preference for a position. Per order the score is
``s = p_B − p_A`` in [−1, 1] (+1: the second completion is better, the cookbook's sign); with
``s_f`` the forward and ``s_s`` the swapped score,

- ``score = (s_f − s_s) / 2`` — how much better B is than A, position bias cancelled;
- ``position_bias = (s_f + s_s) / 2`` — how much the model favours whatever comes second (0 for a
  model that judges content only);
- ``orders_agree`` — the label it would pick is the same completion in both orders.

``second_wins = (1 + score) / 2`` = P(B better) + ½ P(tie) is what a tournament counts as B's win.
``first_wins_by_verdicts`` counts only the label each order would pick (win 1, tie ½, loss 0), averaged over
the orders: the cookbook's comparison evaluator, which reads one greedy verdict token per order, and
AlpacaEval's counting. It ignores how sure the judge was (P = 0.51 counts as a whole win), so an eval reports
both.

Identical completions are a tie without asking the model (``identical=True``, score 0): in both orders the
comparison is the same text, so the averaged score is exactly 0 anyway. A policy's samples and a policy and
its parent often answer alike, so this saves most of the judging in tournaments and win-rate evals.

A judge trained with reference answers (``answers_first=True``, its checkpoint's ``reference: chosen``)
first answers each distinct prompt itself, greedily, with the same weights, and judges every comparison of
that prompt with its own answer in the reference slot (``comparison_format``). The answers are cached per
prompt: the judge is fixed for its lifetime and greedy decoding is deterministic, so a prompt seen again (the
next epoch, the eval's second target) costs no second request. ``answerer`` lets another sampler (e.g. a
stronger checkpoint) write those answers instead of the judge's own weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import tinker

from posttrain.completers import MessageCompleter, PendingMessages, SamplingSettings, TokenCompleter
from posttrain.preference.comparison_format import LABELS, ORDERS, Comparison, ComparisonRenderer, Message, Orders, ScoringInput


@dataclass(frozen=True)
class LabelProbabilities:
    """P(first better), P(second better), P(tie), normalised over the label tokens."""

    first: float
    second: float
    tie: float

    @classmethod
    def from_logprobs(cls, logprobs: dict[str, float]) -> LabelProbabilities:
        labels = [label for label in LABELS if label in logprobs]
        values = np.asarray([logprobs[label] for label in labels], dtype=np.float64)
        probs = np.exp(values - values.max())
        probs /= probs.sum()
        found = dict(zip(labels, probs.tolist()))
        return cls(found.get("A", 0.0), found.get("B", 0.0), found.get("Tie", 0.0))

    @property
    def score(self) -> float:
        """p_B − p_A: +1 when the second completion is surely better."""
        return self.second - self.first

    @property
    def verdict(self) -> str:
        """The most probable label; "Tie" also when A and B are exactly as likely (no preference)."""
        if self.first == self.second or self.tie > max(self.first, self.second):
            return "Tie"
        return "A" if self.first > self.second else "B"


@dataclass(frozen=True)
class PairVerdict:
    """The judgement of one comparison (see the module docstring for the formulas)."""

    score: float
    position_bias: float  # NaN when judged in one order
    orders_agree: bool | None  # None when judged in one order
    forward: LabelProbabilities
    swapped: LabelProbabilities | None
    identical: bool = False  # the two completions are the same text: a tie, not judged

    @property
    def second_wins(self) -> float:
        """B's win in [0, 1]: P(B better) + ½ P(tie), averaged over the orders judged."""
        return (1.0 + self.score) / 2.0

    @property
    def first_wins(self) -> float:
        return 1.0 - self.second_wins

    @property
    def first_wins_by_verdicts(self) -> float:
        """A's win from the label each order would pick (1, ½ for a tie, 0), averaged over the orders judged."""
        wins = [_FIRST_WINS[self.forward.verdict]]
        if self.swapped is not None:
            wins.append(1.0 - _FIRST_WINS[self.swapped.verdict])  # swapped: the original A is shown second
        return sum(wins) / len(wins)


_FIRST_WINS = {"A": 1.0, "B": 0.0, "Tie": 0.5}


def verdict_correct(chosen_wins: float) -> float:
    """1 when the chosen completion is preferred, 0 when the rejected one is, ½ on an exact tie."""
    return 1.0 if chosen_wins > 0.5 else 0.0 if chosen_wins < 0.5 else 0.5


def combine_orders(forward: LabelProbabilities, swapped: LabelProbabilities | None) -> PairVerdict:
    """The verdict of a comparison from its forward and (optionally) its swapped judgement."""
    if swapped is None:
        return PairVerdict(forward.score, math.nan, None, forward, None)
    swapped_back = {"A": "B", "B": "A", "Tie": "Tie"}[swapped.verdict]
    return PairVerdict(
        score=(forward.score - swapped.score) / 2.0,
        position_bias=(forward.score + swapped.score) / 2.0,
        orders_agree=forward.verdict == swapped_back,
        forward=forward,
        swapped=swapped,
    )


TIE = PairVerdict(0.0, math.nan, None, LabelProbabilities(0.5, 0.5, 0.0), None, identical=True)


class PendingVerdict:
    """The compute_logprobs requests of one comparison (one per label and order), in flight; none for a tie."""

    def __init__(self, forward: dict[str, object] | None, swapped: dict[str, object] | None):
        self._forward = forward
        self._swapped = swapped

    def result(self) -> PairVerdict:
        if self._forward is None:
            return TIE
        return combine_orders(_probabilities(self._forward), _probabilities(self._swapped) if self._swapped else None)


def _probabilities(futures: dict[str, object]) -> LabelProbabilities:
    logprobs = {}
    for label, future in futures.items():
        values = future.result()  # type: ignore[attr-defined]
        last = values[-1] if values else None
        if last is None or not math.isfinite(last):
            raise RuntimeError(f"compute_logprobs returned no finite logprob for the label {label!r}: {values[-3:] if values else values}")
        logprobs[label] = float(last)
    return LabelProbabilities.from_logprobs(logprobs)


def prompt_key(prompt: Sequence[Message]) -> str:
    """A prompt conversation's identity for caching the judge's own answer to it."""
    return repr([(message["role"], message["content"]) for message in prompt])


class PreferenceModel:
    """A sampling client on preference-model weights + the comparison renderer it was trained with.

    ``answers_first``: the judge writes its own greedy answer (at most ``answer_max_tokens`` tokens) to each
    prompt and reads it as the comparison's reference (see the module docstring); ``answerer``: the sampler that
    writes that answer, when it is not the judge's own weights."""

    def __init__(
        self,
        sampling_client: tinker.SamplingClient,
        renderer: ComparisonRenderer,
        *,
        orders: Orders = "both",
        labels: Sequence[str] = LABELS,
        answers_first: bool = False,
        answer_max_tokens: int = 64,
        answerer: tinker.SamplingClient | None = None,
    ):
        if orders not in ORDERS:
            raise ValueError(f"orders={orders!r} is not one of {ORDERS}")
        unknown = sorted(set(labels) - set(LABELS))
        if unknown or not {"A", "B"} <= set(labels):
            raise ValueError(f"labels {list(labels)} must include 'A' and 'B' and be among {LABELS}")
        self.sampling_client = sampling_client
        self.renderer = renderer
        self.orders = orders
        self.labels = tuple(labels)
        self.answers_first = answers_first
        self._completer = MessageCompleter(
            TokenCompleter(answerer or sampling_client, SamplingSettings(max_tokens=answer_max_tokens, top_k=1)), renderer.renderer
        )
        self._answers: dict[str, str] = {}

    def own_answer(self, prompt: Sequence[Message]) -> str | None:
        """The judge's own answer to ``prompt``, once it has judged a comparison of it (None before, or without
        ``answers_first``)."""
        return self._answers.get(prompt_key(prompt))

    def _with_own_answers(self, comparisons: Sequence[Comparison]) -> list[Comparison]:
        """Each comparison that needs judging, with the judge's own answer as its reference: one greedy request
        per prompt not answered yet, all in flight before any is awaited."""
        if not self.answers_first:
            return list(comparisons)
        needs_answer = [c.reference is None and c.completion_a != c.completion_b for c in comparisons]
        pending: dict[str, PendingMessages] = {}
        for comparison, needed in zip(comparisons, needs_answer):
            key = prompt_key(comparison.prompt)
            if needed and key not in self._answers and key not in pending:
                pending[key] = self._completer.submit(comparison.prompt, seed=0)
        for key, request in pending.items():
            self._answers[key] = request.result()[0].text
        return [
            c.with_reference([{"role": "assistant", "content": self._answers[prompt_key(c.prompt)]}]) if needed else c
            for c, needed in zip(comparisons, needs_answer)
        ]

    def _submit_order(self, comparison: Comparison) -> dict[str, object]:
        scoring: ScoringInput = self.renderer.scoring_input(comparison, self.labels)
        return {label: self.sampling_client.compute_logprobs(scoring.sequence(label), prompt_logprobs_last_n=1) for label in self.labels}

    def _submit(self, comparison: Comparison) -> PendingVerdict:
        if comparison.completion_a == comparison.completion_b:
            return PendingVerdict(None, None)
        swapped = self._submit_order(comparison.swap()) if self.orders == "both" else None
        return PendingVerdict(self._submit_order(comparison), swapped)

    def judge(self, comparisons: Sequence[Comparison]) -> list[PairVerdict]:
        """Every comparison's verdict; all requests are submitted before any is awaited (the judge's own answers,
        where it writes them, first)."""
        pending = [self._submit(comparison) for comparison in self._with_own_answers(comparisons)]
        return [item.result() for item in pending]
