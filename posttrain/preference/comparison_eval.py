"""Evaluators judged by a preference model (``posttrain.eval.base.Evaluator`` s).

Both report per-item scores (``score_items``, keyed like ``posttrain.eval.accuracy.problem_keys``), from which
an eval report computes n, standard errors and paired differences with the parent.

- :class:`PreferenceAccuracyEvaluator` scores *a preference model*: on held-out comparisons, does it
  prefer the chosen completion (both orders averaged)? Also its accuracy in each order alone, the share of
  comparisons where both orders pick the same completion, and its mean position bias. A judge that answers
  first is scored as it judges in RLHF, with its own answers as references (never the chosen one), and
  reports how often its answer is the chosen completion's text (``own_answer_is_chosen``).
- :class:`ComparisonEvaluator` scores *a policy*: the policy and a fixed reference (e.g. the checkpoint's
  parent) answer each held-out prompt greedily; the preference model judges each pair of answers in both
  orders; the policy's win on a prompt is P(policy better) + ½ P(tie). The win rate is the mean over prompts
  with its standard error; ``verdict_win_rate`` counts each order's most probable label instead (win 1, tie
  ½, loss 0), the tinker-cookbook evaluator's greedy verdicts. Where prompts come with a verifier, both
  answers are also graded: ``accuracy`` is the policy's true held-out accuracy (the check against reward
  hacking), with the paired difference against the reference, and ``win_rate_verifier_tied`` is the win rate
  on the prompts where both answers grade alike (what the policy wins by, other than being right).
Every mean is a ``posttrain.eval.stats`` estimate (value, standard error, n).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from posttrain.completers import ChatRenderer, MessageCompleter, SamplingSettings, TokenCompleter, message_text
from posttrain.eval.base import EvalTarget
from posttrain.eval.items import ItemScores, mean_metrics, unique_keys
from posttrain.eval.stats import mean_estimate, paired_difference
from posttrain.preference.comparison_format import Comparison, ComparisonRenderer, Message
from posttrain.preference.env import PreferencePrompt
from posttrain.preference.preference_model import PairVerdict, PreferenceModel, verdict_correct


def item_keys(conversations: Sequence[list[Message]]) -> list[str]:
    """Item keys of prompt conversations: the hash of (system prompt, last user message), as
    ``posttrain.eval.accuracy.problem_keys`` keys the same problems, so reports pair across evaluators."""
    def text(messages: list[Message]) -> str:
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
        users = [m["content"] for m in messages if m["role"] == "user"]
        return f"{system}\n{users[-1] if users else ''}"

    return unique_keys(text(messages) for messages in conversations)


def summarize(items: ItemScores) -> dict[str, float]:
    """``{metric, metric_stderr, metric_n}`` of each metric's items (``posttrain.eval.stats``)."""
    summary: dict[str, float] = {}
    for metric, values in items.items():
        if values:
            summary.update(mean_estimate(list(values.values())).as_dict(metric))
    return summary


def accuracy_items(verdicts: Sequence[PairVerdict], keys: Sequence[str], prefix: str = "") -> ItemScores:
    """Per comparison whose first completion is the chosen one: preferred both orders averaged, in each order
    alone, whether the orders agree, and the position bias."""
    items: ItemScores = {
        f"{prefix}comparison_accuracy": {k: verdict_correct(v.first_wins) for k, v in zip(keys, verdicts)},
        f"{prefix}accuracy_chosen_first": {k: verdict_correct((1.0 - v.forward.score) / 2) for k, v in zip(keys, verdicts)},
    }
    both = [(k, v, v.swapped) for k, v in zip(keys, verdicts) if v.swapped is not None]
    if both:
        items[f"{prefix}accuracy_chosen_second"] = {k: verdict_correct((1.0 + s.score) / 2) for k, _, s in both}
        items[f"{prefix}orders_agree"] = {k: float(bool(v.orders_agree)) for k, v, _ in both}
        items[f"{prefix}position_bias"] = {k: v.position_bias for k, v, _ in both}
    return items


def accuracy_metrics(verdicts: Sequence[PairVerdict], prefix: str = "") -> dict[str, float]:
    """:func:`accuracy_items` as means with standard errors."""
    return summarize(accuracy_items(verdicts, [str(index) for index in range(len(verdicts))], prefix))


class PreferenceAccuracyEvaluator:
    """``{prefix}comparison_accuracy`` and order statistics of a preference model, per held-out comparison.

    ``comparisons``: held-out comparisons with the *chosen* completion as A.
    """

    def __init__(
        self, comparisons: Sequence[Comparison], renderer: ComparisonRenderer, prefix: str = "eval/", *,
        answers_first: bool = False, answer_max_tokens: int = 64,
    ):
        if not comparisons:
            raise ValueError("PreferenceAccuracyEvaluator got no comparisons: pass the held-out comparisons")
        self.comparisons = list(comparisons)
        self.keys = item_keys([c.prompt for c in self.comparisons])
        self.renderer = renderer
        self.prefix = prefix
        self.answers_first = answers_first
        self.answer_max_tokens = answer_max_tokens

    def score_items(self, target: EvalTarget) -> ItemScores:
        judge = PreferenceModel(
            target.sampling_client(), self.renderer, orders="both", answers_first=self.answers_first, answer_max_tokens=self.answer_max_tokens
        )
        items = accuracy_items(judge.judge(self.comparisons), self.keys, self.prefix)
        if self.answers_first:
            items[f"{self.prefix}own_answer_is_chosen"] = {
                key: matched for key, c in zip(self.keys, self.comparisons) if (matched := own_answer_is_chosen(judge, c)) is not None
            }
        return items

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        return mean_metrics(self.score_items(target))


def own_answer_is_chosen(judge: PreferenceModel, comparison: Comparison) -> float | None:
    """1.0 when the judge's own answer to the prompt is the text of the chosen completion (``completion_a``),
    0.0 when it is not, None when the judge wrote none for it."""
    own = judge.own_answer(comparison.prompt)
    return None if own is None else float(own.strip() == message_text(comparison.completion_a[-1]).strip())


def greedy_answers(target: EvalTarget, renderer: ChatRenderer, prompts: Sequence[PreferencePrompt], max_tokens: int, seed: int) -> list[str]:
    """One greedy answer per prompt (every request in flight before any is awaited)."""
    completer = MessageCompleter(TokenCompleter(target.sampling_client(), SamplingSettings(max_tokens=max_tokens, top_k=1)), renderer)
    pending = [completer.submit(prompt.messages, seed=seed) for prompt in prompts]
    return [request.result()[0].text for request in pending]


class ComparisonEvaluator:
    """``{prefix}win_rate`` (and ``verdict_win_rate``) of a target over a fixed opponent judged by a preference
    model, per held-out prompt.

    The opponent's answers are computed once, at the first call, and reused for every target an eval report
    scores. ``judge`` returns the preference model (created on first use). Where prompts have a verifier,
    ``{prefix}accuracy`` is the target's verifier grade per prompt (the report pairs it with the parent's) and
    ``{prefix}win_rate_verifier_tied`` its win on the prompts where both answers grade alike.
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

    def score_items(self, target: EvalTarget) -> ItemScores:
        if self._opponent_answers is None:
            self._opponent_answers = greedy_answers(self.opponent(), self.renderer, self.prompts, self.max_tokens, self.seed)
        if self._judge is None:
            self._judge = self.judge()
        answers = greedy_answers(target, self.renderer, self.prompts, self.max_tokens, self.seed)
        return comparison_items(self.prompts, answers, self._opponent_answers, self._judge, self.prefix)

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        return mean_metrics(self.score_items(target))


def comparison_items(
    prompts: Sequence[PreferencePrompt], answers: Sequence[str], opponent_answers: Sequence[str], judge: PreferenceModel, prefix: str = ""
) -> ItemScores:
    """Per prompt: the win of ``answers`` over ``opponent_answers`` (policy shown first, both orders judged), by
    probabilities and by verdicts, and the judge's position bias. Where the prompt has a verifier: the grade of
    ``answers`` (``accuracy``), and the win again on the prompts where both answers grade alike
    (``win_rate_verifier_tied``: ½ for a judge that follows the verifier; above ½, the policy wins on something
    the verifier does not check — its style, or the judge's blind spots)."""
    comparisons = [
        Comparison(prompt.messages, [{"role": "assistant", "content": mine}], [{"role": "assistant", "content": theirs}])
        for prompt, mine, theirs in zip(prompts, answers, opponent_answers, strict=True)
    ]
    keys = item_keys([prompt.messages for prompt in prompts])
    verdicts = judge.judge(comparisons)
    items: ItemScores = {
        f"{prefix}win_rate": {k: v.first_wins for k, v in zip(keys, verdicts)},
        f"{prefix}verdict_win_rate": {k: v.first_wins_by_verdicts for k, v in zip(keys, verdicts)},
    }
    biased = {k: v.position_bias for k, v in zip(keys, verdicts) if v.swapped is not None}
    if biased:
        items[f"{prefix}judge_position_bias"] = biased
    graded = _grades(prompts, keys, answers)
    if graded:
        items[f"{prefix}accuracy"] = graded
        theirs = _grades(prompts, keys, opponent_answers)
        tied = {k: items[f"{prefix}win_rate"][k] for k, grade in graded.items() if theirs.get(k) == grade}
        if tied:
            items[f"{prefix}win_rate_verifier_tied"] = tied
    return items


def _grades(prompts: Sequence[PreferencePrompt], keys: Sequence[str], answers: Sequence[str]) -> dict[str, float]:
    """The verifier grade of each answer, by item key, where its prompt has a verifier."""
    return {k: grade for k, p, answer in zip(keys, prompts, answers) if (grade := p.grade(answer)) is not None}


def comparison_metrics(
    prompts: Sequence[PreferencePrompt], answers: Sequence[str], opponent_answers: Sequence[str], judge: PreferenceModel, prefix: str = ""
) -> dict[str, float]:
    """:func:`comparison_items` as means with standard errors, plus the opponent's verifier accuracy and the
    paired difference of accuracies where the prompts have verifiers."""
    items = comparison_items(prompts, answers, opponent_answers, judge, prefix)
    metrics = summarize(items)
    mine = items.get(f"{prefix}accuracy")
    if mine:
        theirs = _grades(prompts, item_keys([prompt.messages for prompt in prompts]), opponent_answers)
        metrics[f"{prefix}opponent_accuracy"] = mean_estimate(list(theirs.values())).value
        difference = paired_difference(mine, theirs)
        metrics.update({f"{prefix}accuracy_delta": difference.delta, f"{prefix}accuracy_delta_stderr": difference.stderr})
    return metrics
