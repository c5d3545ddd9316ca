"""Code pass@1 / pass@k: exact values on a scripted sampler, then a real model through the SDK."""

from types import SimpleNamespace

import pytest

from posttrain.datasets.loaders import LoadSpec, load
from posttrain.datasets.problems import code_problems_from_table
from posttrain.eval.base import EvalTarget
from posttrain.eval.code_pass import CodePassEvaluator, evaluate_code_pass
from posttrain.renderers import get_renderer
from posttrain.sandbox import Limits
from tests.fixtures.server import TINY_MODEL
from tests.posttrain.supervised.tiny_data import tiny_tokenizer

LIMITS = Limits(timeout_s=10, memory_mb=256)


class ScriptedSampler:
    """A sampling client whose answers are fixed per problem: greedy (top_k=1) and sampled lists."""

    def __init__(self, renderer, script: dict[str, tuple[str, list[str]]]):
        self.renderer = renderer
        self.script = script
        self.requests: list[tuple[str, int, int]] = []  # (entry point, num_samples, top_k)

    def sample(self, prompt, num_samples, sampling_params):
        text = tiny_tokenizer().decode(prompt.to_ints())
        name = next(name for name in self.script if f"`{name}(" in text)
        self.requests.append((name, num_samples, sampling_params.top_k))
        greedy, sampled = self.script[name]
        answers = [greedy] if sampling_params.top_k == 1 else sampled[:num_samples]
        stop = list(self.renderer.get_stop_sequences())
        sequences = []
        for answer in answers:
            tokens = tiny_tokenizer().encode(answer, add_special_tokens=False) + stop
            sequences.append(SimpleNamespace(tokens=tokens, logprobs=[-1.0] * len(tokens), stop_reason="stop"))
        return SimpleNamespace(result=lambda: SimpleNamespace(sequences=sequences))


@pytest.fixture(scope="module")
def problems():
    table = load(LoadSpec(kind="code", source="code_tasks:easy?count=30")).table
    return code_problems_from_table(table)[:2]


def block(code: str) -> str:
    return f"```python\n{code}```"


def test_greedy_pass_at_1_and_unbiased_pass_at_k_from_graded_samples(problems):
    renderer = get_renderer("chatml", tiny_tokenizer())
    first, second = problems
    wrong_first = block(f"{first.starter_code}    return None\n")
    script = {
        # greedy right; 2 of 4 samples pass -> pass@2 = 1 - C(2,2)/C(4,2) = 5/6
        first.entry_point: (block(first.reference_solution), [block(first.reference_solution), wrong_first, first.reference_solution, block(first.reference_solution)]),
        # greedy has no code block; 1 of 4 samples passes -> pass@2 = 1 - C(3,2)/C(4,2) = 1/2
        second.entry_point: (second.reference_solution, [block(second.reference_solution)] + [block(f"{second.starter_code}    return None\n")] * 3),
    }
    sampler = ScriptedSampler(renderer, script)
    result = evaluate_code_pass(EvalTarget(sampling_client=sampler), renderer, problems, k=2, num_samples=4, limits=LIMITS)

    assert result.pass_at_1 == 0.5
    assert result.pass_at_k == pytest.approx((5 / 6 + 1 / 2) / 2)
    assert result.format_rate == pytest.approx(8 / 10)  # the second greedy and one sampled answer lack a block
    assert sorted(sampler.requests) == sorted([(first.entry_point, 1, 1), (first.entry_point, 4, -1), (second.entry_point, 1, 1), (second.entry_point, 4, -1)])
    statuses = [(s.row_id, s.greedy, s.status) for s in result.samples]
    assert statuses[:2] == [(first.row_id, True, "passed"), (first.row_id, False, "passed")]
    assert (second.row_id, True, "no_code_block") in statuses
    failed = next(s for s in result.samples if s.status == "failed")
    assert "AssertionError" in failed.test_output
    assert result.sampled_pass_at_1 == 3 / 8
    assert result.metrics("suite/") == {"suite/accuracy": 0.5, "suite/pass@2": result.pass_at_k, "suite/pass@1": 3 / 8,
                                        "suite/format_rate": 0.8, "suite/num_problems": 2.0}


def test_k_zero_skips_sampling_and_bad_k_is_refused(problems):
    renderer = get_renderer("chatml", tiny_tokenizer())
    script = {p.entry_point: (block(p.reference_solution), []) for p in problems}
    sampler = ScriptedSampler(renderer, script)
    result = evaluate_code_pass(EvalTarget(sampling_client=sampler), renderer, problems, k=0, limits=LIMITS)
    assert result.metrics() == {"accuracy": 1.0, "format_rate": 1.0, "num_problems": 2.0}
    assert all(num_samples == 1 for _, num_samples, _ in sampler.requests)
    with pytest.raises(ValueError, match="k=3, num_samples=2"):
        evaluate_code_pass(EvalTarget(sampling_client=sampler), renderer, problems, k=3, num_samples=2)
    with pytest.raises(ValueError, match="got no problems"):
        CodePassEvaluator("chatml", [])


def test_evaluator_on_a_real_model_through_the_sdk(service_client, problems):
    evaluator = CodePassEvaluator("chatml", problems, prefix="humaneval/", k=2, max_tokens=8, limits=LIMITS)
    metrics = evaluator(EvalTarget.from_base_model(service_client, TINY_MODEL, tiny_tokenizer()))
    assert set(metrics) == {"humaneval/accuracy", "humaneval/pass@2", "humaneval/pass@1", "humaneval/format_rate", "humaneval/num_problems"}
    assert all(0.0 <= metrics[name] <= 1.0 for name in ("humaneval/pass@1", "humaneval/pass@2", "humaneval/format_rate"))
    samples = evaluator.last_result.samples
    assert len(samples) == 2 * 3 and all(0 < s.num_tokens <= 8 for s in samples)
    assert metrics["humaneval/accuracy"] == sum(s.passed for s in samples if s.greedy) / 2
