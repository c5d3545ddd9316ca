"""Greedy pass rate and pass@k (sampled, unbiased) on code problems, every program run in the sandbox.

Per problem the policy answers once greedily (``top_k=1``: the reproducible ``accuracy`` an eval report
compares, named like every recipe's greedy task score) and ``num_samples`` times at ``temperature`` (default 1); pass@k is the unbiased estimate
1 − C(n−c, k)/C(n, k) from those n samples with c passing (``posttrain.eval.pass_at_k.pass_at_k``),
averaged over problems. Answers are asked for and graded exactly as in code RL
(``posttrain.rl.envs.code_env.code_messages``, ``posttrain.rl.code_reward``): the program is the last
fenced block, and it passes when every test does.

Every sampling request is submitted before any is awaited, and each program is queued on the sandbox
pool as soon as its answer is read. Metric names are unprefixed by default (``accuracy`` = greedy pass
rate, ``pass@1`` = c/n over the temperature samples — the unbiased pass@1, as in every recipe's report —
``pass@4``, ``format_rate``, ``num_problems``); ``prefix="humaneval/"`` keeps two suites apart in one
report. A small instruct model can be far better greedy than sampled at temperature 1, so ``pass@1`` is
where RL shows first.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

from posttrain.completers import ChatRenderer, MessageCompleter, ParsedCompletion, SamplingSettings, TokenCompleter
from posttrain.datasets.problems import CodeProblem
from posttrain.eval.base import EvalTarget
from posttrain.eval.items import unique_keys
from posttrain.eval.pass_at_k import pass_at_k
from posttrain.rl.code_reward import CodeGrade, submit_code_reward
from posttrain.rl.envs.code_env import code_messages, test_output_tail
from posttrain.sandbox import Limits, ProblemTests, SandboxPool

DEFAULT_MAX_TOKENS = 256


@dataclass
class CodeSample:
    row_id: str
    greedy: bool
    response: str
    status: str
    passed: bool
    has_code_block: bool
    test_output: str
    num_tokens: int


@dataclass
class CodePassResult:
    pass_at_1: float  # greedy
    pass_at_k: float | None  # None when no samples were drawn (k = 0)
    sampled_pass_at_1: float | None  # share of the temperature samples that pass (c/n): what RL moves first
    k: int
    num_problems: int
    format_rate: float  # share of answers (greedy and sampled) with a fenced code block
    samples: list[CodeSample] = field(default_factory=list)

    def metrics(self, prefix: str = "") -> dict[str, float]:
        found = {f"{prefix}accuracy": self.pass_at_1, f"{prefix}format_rate": self.format_rate, f"{prefix}num_problems": float(self.num_problems)}
        if self.sampled_pass_at_1 is not None:
            found[f"{prefix}pass@1"] = self.sampled_pass_at_1
        if self.pass_at_k is not None:
            found[f"{prefix}pass@{self.k}"] = self.pass_at_k
        return found

    def sample_dicts(self) -> list[dict[str, Any]]:
        return [asdict(sample) for sample in self.samples]


def evaluate_code_pass(
    target: EvalTarget,
    renderer: ChatRenderer,
    problems: Sequence[CodeProblem],
    *,
    k: int = 4,
    num_samples: int | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    temperature: float = 1.0,
    seed: int = 0,
    system: str | None = None,
    limits: Limits | None = None,
    pool: SandboxPool | None = None,
) -> CodePassResult:
    """Greedy pass@1, and pass@k from ``num_samples`` (default k) samples per problem; k = 0 skips sampling."""
    samples_per_problem = k if num_samples is None else num_samples
    if not problems:
        raise ValueError("evaluate_code_pass got no problems: pass at least one CodeProblem")
    if k < 0 or (k > 0 and samples_per_problem < k):
        raise ValueError(f"pass@k needs 0 <= k <= num_samples; got k={k}, num_samples={samples_per_problem}")
    sampling = target.sampling_client()
    greedy = MessageCompleter(TokenCompleter(sampling, SamplingSettings(max_tokens=max_tokens, top_k=1)), renderer)
    sampled = MessageCompleter(TokenCompleter(sampling, SamplingSettings(max_tokens=max_tokens, temperature=temperature)), renderer)
    requests = [
        (
            greedy.submit(code_messages(problem, system), seed=seed),
            sampled.submit(code_messages(problem, system), num_samples=samples_per_problem, seed=seed) if k > 0 else None,
        )
        for problem in problems
    ]
    graded: list[tuple[CodeProblem, bool, ParsedCompletion, Future[CodeGrade]]] = []
    for problem, (greedy_request, sampled_request) in zip(problems, requests, strict=True):
        tests = ProblemTests.from_row(problem)
        answers = [(True, c) for c in greedy_request.result()] + [(False, c) for c in (sampled_request.result() if sampled_request else [])]
        graded += [(problem, is_greedy, c, submit_code_reward(c.text, tests, limits=limits, pool=pool)) for is_greedy, c in answers]
    samples = [_sample(problem, is_greedy, completion, future.result()) for problem, is_greedy, completion, future in graded]
    drawn = [s.passed for s in samples if not s.greedy]
    return CodePassResult(
        pass_at_1=_mean([s.passed for s in samples if s.greedy]),
        pass_at_k=_mean([_problem_pass_at_k(samples, p.row_id, k) for p in problems]) if k > 0 else None,
        sampled_pass_at_1=_mean(drawn) if drawn else None,
        k=k,
        num_problems=len(problems),
        format_rate=_mean([s.has_code_block for s in samples]),
        samples=samples,
    )


class CodePassEvaluator:
    """An :class:`~posttrain.eval.base.Evaluator` reporting ``{prefix}pass@1`` (greedy), ``{prefix}pass@{k}``,
    ``{prefix}pass@1`` (sampled), ``{prefix}format_rate`` and ``{prefix}num_problems``.

    ``renderer`` may be a renderer name (built on first use over the target's tokenizer); ``settings``
    go to :func:`evaluate_code_pass` (k, num_samples, max_tokens, seed, limits, pool ...). The last
    result, with every sample, is kept in ``last_result``.
    """

    def __init__(self, renderer: ChatRenderer | str, problems: Sequence[CodeProblem], prefix: str = "", **settings: Any):
        if not problems:
            raise ValueError(f"CodePassEvaluator{f' {prefix!r}' if prefix else ''} got no problems: check the split and max_problems")
        self.renderer = renderer
        self.problems = list(problems)
        self.prefix = prefix
        self.settings = settings
        self.last_result: CodePassResult | None = None

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        if isinstance(self.renderer, str):
            from posttrain.renderers import get_renderer

            self.renderer = get_renderer(self.renderer, target.tokenizer())
        self.last_result = evaluate_code_pass(target, self.renderer, self.problems, **self.settings)
        return self.last_result.metrics(self.prefix)

    def score_items(self, target: EvalTarget) -> dict[str, dict[str, float]]:
        """Per problem (keyed by its prompt's hash): greedy pass, sampled c/n, pass@k and code-block rate."""
        self(target)
        assert self.last_result is not None
        result, prefix = self.last_result, self.prefix
        keys = unique_keys(problem.prompt for problem in self.problems)
        by_problem = [[s for s in result.samples if s.row_id == problem.row_id] for problem in self.problems]
        scores = {
            f"{prefix}accuracy": {k: _mean([s.passed for s in ss if s.greedy]) for k, ss in zip(keys, by_problem)},
            f"{prefix}format_rate": {k: _mean([s.has_code_block for s in ss]) for k, ss in zip(keys, by_problem)},
        }
        if result.k > 0:
            scores[f"{prefix}pass@1"] = {k: _mean([s.passed for s in ss if not s.greedy]) for k, ss in zip(keys, by_problem)}
            scores[f"{prefix}pass@{result.k}"] = {
                k: _problem_pass_at_k(result.samples, p.row_id, result.k) for k, p in zip(keys, self.problems)
            }
        return scores


def _sample(problem: CodeProblem, is_greedy: bool, completion: ParsedCompletion, grade: CodeGrade) -> CodeSample:
    return CodeSample(
        row_id=problem.row_id,
        greedy=is_greedy,
        response=completion.text,
        status=grade.status,
        passed=grade.all_tests_pass,
        has_code_block=grade.has_code_block,
        test_output=test_output_tail(grade),
        num_tokens=len(completion.sampled.tokens),
    )


def _problem_pass_at_k(samples: list[CodeSample], row_id: str, k: int) -> float:
    drawn = [s for s in samples if s.row_id == row_id and not s.greedy]
    return pass_at_k(len(drawn), sum(s.passed for s in drawn), k)


def _mean(values: Sequence[float | bool]) -> float:
    return sum(float(v) for v in values) / len(values) if values else 0.0
