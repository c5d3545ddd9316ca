"""Evaluators judged by a preference model (``posttrain.eval.base.Evaluator`` s).

- :class:`PreferenceAccuracyEvaluator` scores *a preference model*: on held-out comparisons, does it
  prefer the chosen completion (both orders averaged)? Also its accuracy in each order alone, the share of
  comparisons where both orders pick the same completion, and its mean position bias.
- :class:`ComparisonEvaluator` scores *a policy*: the policy and a fixed reference (e.g. the checkpoint's
  parent) answer each held-out prompt greedily; the preference model judges each pair of answers in both
  orders; the policy's win on a prompt is P(policy better) + ½ P(tie). The win rate is the mean over prompts
  with its standard error. Where prompts come with a verifier, both answers are also graded: ``accuracy``
  is the policy's true held-out accuracy (the check against reward hacking), with the paired difference
  against the reference.
Every mean is a ``posttrain.eval.stats`` estimate (value, standard error, n).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from posttrain.completers import ChatRenderer, MessageCompleter, SamplingSettings, TokenCompleter
from posttrain.eval.base import EvalTarget
from posttrain.eval.stats import mean_estimate, paired_difference
from posttrain.preference.comparison_format import Comparison, ComparisonRenderer
from posttrain.preference.env import PreferencePrompt
from posttrain.preference.preference_model import PairVerdict, PreferenceModel


def verdict_correct(chosen_wins: float) -> float:
    """1 when the chosen completion is preferred, 0 when the rejected one is, ½ on an exact tie."""
    return 1.0 if chosen_wins > 0.5 else 0.0 if chosen_wins < 0.5 else 0.5


class PreferenceAccuracyEvaluator:
    """``{prefix}comparison_accuracy`` (± s.e.) and order statistics of a preference model.

    ``comparisons``: held-out comparisons with the *chosen* completion as A.
    """

    def __init__(self, comparisons: Sequence[Comparison], renderer: ComparisonRenderer, prefix: str = "eval/"):
        if not comparisons:
            raise ValueError("PreferenceAccuracyEvaluator got no comparisons: pass the held-out comparisons")
        self.comparisons = list(comparisons)
        self.renderer = renderer
        self.prefix = prefix

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        verdicts = PreferenceModel(target.sampling_client(), self.renderer, orders="both").judge(self.comparisons)
        return accuracy_metrics(verdicts, self.prefix)


def accuracy_metrics(verdicts: Sequence[PairVerdict], prefix: str = "") -> dict[str, float]:
    """Metrics of verdicts on comparisons whose first completion is the chosen one."""
    metrics: dict[str, float] = {}
    metrics.update(mean_estimate([verdict_correct(v.first_wins) for v in verdicts]).as_dict(f"{prefix}comparison_accuracy"))
    metrics.update(mean_estimate([verdict_correct((1.0 - v.forward.score) / 2) for v in verdicts]).as_dict(f"{prefix}accuracy_chosen_first"))
    swapped = [v.swapped for v in verdicts if v.swapped is not None]
    if swapped:
        metrics.update(mean_estimate([verdict_correct((1.0 + s.score) / 2) for s in swapped]).as_dict(f"{prefix}accuracy_chosen_second"))
        metrics.update(mean_estimate([float(bool(v.orders_agree)) for v in verdicts]).as_dict(f"{prefix}orders_agree"))
        metrics.update(mean_estimate([v.position_bias for v in verdicts]).as_dict(f"{prefix}position_bias"))
    return metrics


def greedy_answers(target: EvalTarget, renderer: ChatRenderer, prompts: Sequence[PreferencePrompt], max_tokens: int, seed: int) -> list[str]:
    """One greedy answer per prompt (every request in flight before any is awaited)."""
    completer = MessageCompleter(TokenCompleter(target.sampling_client(), SamplingSettings(max_tokens=max_tokens, top_k=1)), renderer)
    pending = [completer.submit(prompt.messages, seed=seed) for prompt in prompts]
    return [request.result()[0].text for request in pending]


class ComparisonEvaluator:
    """``{prefix}win_rate`` (± s.e.) of a target over a fixed opponent, judged by a preference model.

    The opponent's answers (and verifier grades) are computed once, at the first call, and reused for
    every target an eval report scores. ``judge`` returns the preference model (created on first use).
    """

    def __init__(
        self,
        renderer: ChatRenderer,
        prompts: Sequence[PreferencePrompt],
        opponent: Callable[[], EvalTarget],
        judge: Callable[[], PreferenceModel],
        *,
        max_tokens: int = 64,
        seed: int = 0,
        prefix: str = "",
    ):
        if not prompts:
            raise ValueError("ComparisonEvaluator got no prompts: pass the held-out prompts")
        self.renderer = renderer
        self.prompts = list(prompts)
        self.opponent = opponent
        self.judge = judge
        self.max_tokens = max_tokens
        self.seed = seed
        self.prefix = prefix
        self._opponent_answers: list[str] | None = None
        self._judge: PreferenceModel | None = None

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        if self._opponent_answers is None:
            self._opponent_answers = greedy_answers(self.opponent(), self.renderer, self.prompts, self.max_tokens, self.seed)
        if self._judge is None:
            self._judge = self.judge()
        answers = greedy_answers(target, self.renderer, self.prompts, self.max_tokens, self.seed)
        return comparison_metrics(self.prompts, answers, self._opponent_answers, self._judge, self.prefix)


def comparison_metrics(
    prompts: Sequence[PreferencePrompt], answers: Sequence[str], opponent_answers: Sequence[str], judge: PreferenceModel, prefix: str = ""
) -> dict[str, float]:
    """Win rate of ``answers`` over ``opponent_answers`` (policy shown first, both orders judged), and
    verifier accuracy with its paired difference where the prompts have verifiers."""
    comparisons = [
        Comparison(prompt.messages, [{"role": "assistant", "content": mine}], [{"role": "assistant", "content": theirs}])
        for prompt, mine, theirs in zip(prompts, answers, opponent_answers, strict=True)
    ]
    verdicts = judge.judge(comparisons)
    metrics = mean_estimate([v.first_wins for v in verdicts]).as_dict(f"{prefix}win_rate")
    biases = [v.position_bias for v in verdicts if v.swapped is not None]
    if biases:
        metrics.update(mean_estimate(biases).as_dict(f"{prefix}judge_position_bias"))
    graded = [(p.row_id, p.grade(mine), p.grade(theirs)) for p, mine, theirs in zip(prompts, answers, opponent_answers) if p.problem]
    if graded:
        metrics.update(mean_estimate([mine for _, mine, _ in graded]).as_dict(f"{prefix}accuracy"))
        metrics[f"{prefix}opponent_accuracy"] = mean_estimate([theirs for _, _, theirs in graded]).value
        difference = paired_difference({k: m for k, m, _ in graded}, {k: t for k, _, t in graded})
        metrics.update({f"{prefix}accuracy_delta": difference.delta, f"{prefix}accuracy_delta_stderr": difference.stderr})
    return metrics
