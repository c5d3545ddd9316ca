"""Continuous batching and prompt sharing: same results as sampling alone, with less prefill and no waiting."""

from __future__ import annotations

import numpy as np
import pytest

from localtinker.engine.api import AdamSpec, EngineUserError, LoraSpec, SampleResult, SampleSpec
from localtinker.engine.sample_stream import SampleStream
from tests.localtinker.engine.reference import TINY, sft_datum

SYSTEM = tuple(range(400, 412))
PROMPT_A = SYSTEM + (21, 22, 23, 24)
PROMPT_B = SYSTEM + (31, 32)
PROMPT_C = (41, 42, 43, 44, 45, 46, 47)


@pytest.fixture(scope="module")
def samplers(engine):
    """Two samplers with different weights: ``lora-a`` (a trained adapter) and ``tiny-base`` (no adapter)."""
    model_id = "stream:train:0"
    engine.create_model(model_id, TINY, LoraSpec(rank=4, seed=3))
    rng = np.random.default_rng(1)
    for _ in range(2):
        engine.forward_backward(model_id, [sft_datum(rng, 16)], "cross_entropy", None, False)
        engine.optim_step(model_id, AdamSpec(learning_rate=0.05))
    engine.create_ephemeral_sampler("lora-a", model_id)
    engine.create_sampler("tiny-base", TINY, None)
    return "lora-a", "tiny-base"


def spec(prompt, seed, max_tokens=6, **kwargs) -> SampleSpec:
    return SampleSpec(prompt_tokens=prompt, max_tokens=max_tokens, seed=seed, stop_token_ids=(), **kwargs)


def alone(engine, sampler: str, request: SampleSpec) -> SampleResult:
    return engine.sample_batch([(sampler, request)])[0]


def assert_same(result: SampleResult, expected: SampleResult) -> None:
    assert [s.tokens for s in result.sequences] == [s.tokens for s in expected.sequences]
    for got, want in zip(result.sequences, expected.sequences):
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, rtol=2e-6)  # float32 sum order
        assert got.stop_reason == want.stop_reason


def run_to_end(stream: SampleStream) -> dict:
    results = {}
    while stream.busy:
        results.update(stream.step())
    return results


def sample_together(engine, sampler: str, requests: dict[str, SampleSpec]) -> tuple[SampleStream, dict]:
    """All ``requests`` submitted to one stream at once and run to the end: (the stream, results by key)."""
    stream = engine.sample_stream()
    for key, request in requests.items():
        stream.submit(key, sampler, request)
    return stream, run_to_end(stream)


def assert_each_as_alone(engine, sampler: str, requests: dict[str, SampleSpec], results: dict) -> None:
    for key, request in requests.items():
        assert_same(results[key], alone(engine, sampler, request))


def test_rows_lie_in_the_order_of_their_prompts_whatever_the_order_of_the_requests(engine, samplers):
    """The prefill numbers prompts shortest first; the rows follow those numbers, so a batch of GRPO groups
    (as many samples per prompt) is one bucket in row order for the attention's per-prompt products, which
    then read the queries as they lie (no gather and scatter of them in every layer)."""
    lora, _ = samplers
    requests = {
        "long": spec(PROMPT_A, seed=6, num_samples=2),
        "short": spec(PROMPT_C, seed=7, num_samples=2),
        "middle": spec(PROMPT_B, seed=8, num_samples=2),
    }
    stream = engine.sample_stream()
    for key, request in requests.items():
        stream.submit(key, lora, request)
    results = dict(stream.step())  # the admission
    (group,) = stream._groups.values()
    prompts = [row.request.spec.prompt_tokens for row in group.batch.rows]
    assert prompts == [PROMPT_C] * 2 + [PROMPT_B] * 2 + [PROMPT_A] * 2  # by length, not by arrival
    assert group.batch.cache.groups.in_row_order
    results.update(run_to_end(stream))
    assert_each_as_alone(engine, lora, requests, results)


def test_each_distinct_prompt_is_prefilled_once_with_the_results_of_sampling_alone(engine, samplers):
    lora, _ = samplers
    requests = {
        "group": spec(PROMPT_A, seed=1, num_samples=4),
        "same-prompt-1": spec(PROMPT_A, seed=2),
        "same-prompt-2": spec(PROMPT_A, seed=3, max_tokens=9),
        "other-group": spec(PROMPT_B, seed=4, num_samples=3, temperature=0.7),
        "no-shared-prefix": spec(PROMPT_C, seed=5, top_k=20),
    }
    stream, results = sample_together(engine, lora, requests)
    # three distinct prompts, prefilled once each (no prefix common to all three)
    assert stream.stats.prefill_tokens == len(PROMPT_A) + len(PROMPT_B) + len(PROMPT_C)
    assert_each_as_alone(engine, lora, requests, results)
    assert len({tuple(s.tokens) for s in results["group"].sequences}) == 4  # a group's samples differ


def test_rows_beyond_one_logit_block_get_the_results_of_sampling_alone(engine, samplers):
    """A decode step chooses tokens ``SAMPLING_BLOCK_ROWS`` rows at a time: rows of a request that spans
    two blocks, with per-request temperature, top-k and greedy rows, still get their own tokens."""
    from localtinker.engine.logprobs import SAMPLING_BLOCK_ROWS

    lora, _ = samplers
    requests = {
        "warm": spec(PROMPT_A, seed=11, num_samples=SAMPLING_BLOCK_ROWS - 5, temperature=0.8),
        "spanning": spec(PROMPT_B, seed=12, num_samples=12, top_k=30),
        "greedy": spec(PROMPT_C, seed=13, num_samples=2, temperature=0.0),
        "plain": spec(PROMPT_C, seed=14, num_samples=3),
    }
    _, results = sample_together(engine, lora, requests)
    assert_each_as_alone(engine, lora, requests, results)


def test_a_request_joins_a_running_batch_and_a_short_one_leaves_first(engine, samplers):
    lora, _ = samplers
    long, short = spec(PROMPT_C, seed=7, max_tokens=30), spec(PROMPT_B, seed=8, max_tokens=3)
    stream = engine.sample_stream()
    stream.submit("long", lora, long)
    completed = []
    for _ in range(4):
        completed += stream.step()
    assert completed == [] and stream.stats.decode_steps == 4
    stream.submit("short", lora, short)
    order, short_done_at = [], None
    while stream.busy:
        order += [key for key, _ in stream.step()]
        if "short" in order and short_done_at is None:
            short_done_at = stream.stats.decode_steps
    # admission samples the short request's first token, two decode steps the other two
    assert order == ["short", "long"] and short_done_at == 4 + 2
    assert stream.stats.joined_mid_decode == 1


def test_a_prompt_already_decoding_is_shared_not_prefilled_again(engine, samplers):
    lora, _ = samplers
    first, second = spec(PROMPT_A, seed=11, max_tokens=12), spec(PROMPT_A, seed=12, max_tokens=4, num_samples=2)
    stream = engine.sample_stream()
    stream.submit("first", lora, first)
    results = dict(stream.step() + stream.step())
    prefilled = stream.stats.prefill_tokens
    stream.submit("second", lora, second)
    results.update(stream.step())
    (group,) = stream._groups.values()
    cache = group.batch.cache
    assert cache.rows == 3 and cache.prompts == 1  # three rows over one stored copy of the prompt
    assert cache.layers[0].prompt_keys[0].shape[-2] == len(PROMPT_A)
    results.update(run_to_end(stream))
    assert stream.stats.prefill_tokens == prefilled and stream.stats.shared_prompts == 1
    assert_same(results["second"], alone(engine, lora, second))
    assert_same(results["first"], alone(engine, lora, first))


def test_a_long_prompt_does_not_pad_the_short_ones_and_every_result_is_that_of_sampling_alone(engine, samplers):
    """One 400-token prompt among 6-token ones: prefilled and stored apart, not as wide as the longest."""
    lora, _ = samplers
    requests = {"long": spec(tuple(range(700, 1100)), seed=31, max_tokens=5, num_samples=2)}
    shorts = [tuple(range(50 + 10 * i, 56 + 10 * i)) for i in range(6)]
    requests |= {f"short-{i}": spec(prompt, seed=40 + i, num_samples=2) for i, prompt in enumerate(shorts)}
    stream = engine.sample_stream()
    for key, request in requests.items():
        stream.submit(key, lora, request)
    results = dict(stream.step())
    (group,) = stream._groups.values()
    cache = group.batch.cache
    assert sorted(mask.shape for mask in cache.prompt_masks) == [(1, 400), (6, 6)]
    assert stream.stats.prefill_tokens == 400 + 6 * 6 and stream.stats.prefill_padding == 0
    results.update(run_to_end(stream))
    for key, request in requests.items():
        assert_same(results[key], alone(engine, lora, request))


def test_prompts_behind_a_shared_prefix_are_grouped_by_what_the_prefill_pads(engine, samplers):
    """A 30-token system prompt then 8 or 11 own tokens: the prefill pads the own parts, 3 columns on the
    short ones, so every prompt goes through one forward and one prompt shelf (their whole lengths, 38
    and 41, are two width classes)."""
    lora, _ = samplers
    system = tuple(range(600, 630))
    prompts = [system + tuple(range(700 + 20 * i, 700 + 20 * i + (8 if i % 2 else 11))) for i in range(4)]
    requests = {f"p{i}": spec(prompt, seed=50 + i, num_samples=2) for i, prompt in enumerate(prompts)}
    stream = engine.sample_stream()
    for key, request in requests.items():
        stream.submit(key, lora, request)
    results = dict(stream.step())
    (group,) = stream._groups.values()
    assert [mask.shape for mask in group.batch.cache.prompt_masks] == [(4, 41)]
    assert stream.stats.prefill_tokens == 30 + 2 * 8 + 2 * 11 and stream.stats.prefill_padding == 2 * 3
    results.update(run_to_end(stream))
    assert_each_as_alone(engine, lora, requests, results)


def test_requests_mid_decode_match_sampling_alone_across_weights(engine, samplers):
    """Rows joining, finishing and compacting around a request never change its tokens or logprobs."""
    lora, base = samplers
    stream = engine.sample_stream()
    plan = [  # (step to submit at, key, sampler, request)
        (0, "a", lora, spec(PROMPT_C, seed=21, max_tokens=20)),
        (0, "b", base, spec(PROMPT_C, seed=21, max_tokens=20)),
        (2, "c", lora, spec(PROMPT_A, seed=22, max_tokens=3, num_samples=3)),
        (3, "d", lora, spec(tuple(range(600, 640)), seed=23, max_tokens=10, prompt_logprobs=True)),
        (5, "e", base, spec(PROMPT_B, seed=24, max_tokens=1)),
        (6, "f", lora, spec(PROMPT_A, seed=25, max_tokens=8, top_p=0.8)),
    ]
    results = {}
    for step in range(40):
        for _, key, sampler, request in [p for p in plan if p[0] == step]:
            stream.submit(key, sampler, request)
        results.update(stream.step())
    assert not stream.busy and set(results) == set("abcdef")
    for _, key, sampler, request in plan:
        expected = alone(engine, sampler, request)
        assert_same(results[key], expected)
        if request.prompt_logprobs:
            np.testing.assert_allclose(results[key].prompt_logprobs[1:], expected.prompt_logprobs[1:], atol=1e-5)
    assert results["a"].sequences[0].logprobs != results["b"].sequences[0].logprobs  # different weights


def test_the_kv_budget_admits_samplers_round_robin(engine, samplers):
    lora, base = samplers
    stream = SampleStream(engine, budget_tokens=len(PROMPT_C) + 4)  # one request decodes at a time
    for index in range(3):
        stream.submit(f"flood-{index}", lora, spec(PROMPT_C, seed=index, max_tokens=4))
    stream.submit("other-client", base, spec(PROMPT_C, seed=9, max_tokens=4))
    finished = run_to_end_ordered(stream)
    assert [key for _, key in finished[:2]] == ["flood-0", "other-client"]
    assert [step for step, _ in finished] == [3, 6, 9, 12]  # one at a time; 4 tokens take 3 steps + admission


def test_the_kv_budget_counts_a_prompt_once_for_its_samples(engine, samplers):
    lora, _ = samplers
    per_request = len(PROMPT_C) + 2 * 4  # the prompt once, each sample's 4 new tokens
    stream = SampleStream(engine, budget_tokens=2 * per_request)  # copying the prompt per sample would not fit two
    for index in range(3):
        stream.submit(f"pair-{index}", lora, spec(PROMPT_C, seed=index, max_tokens=4, num_samples=2))
    stream.step()
    assert stream.stats.requests == 2  # the third waits for room
    run_to_end(stream)
    assert stream.stats.requests == 3


def run_to_end_ordered(stream: SampleStream) -> list[tuple[int, str]]:
    finished, step = [], 0
    while stream.busy:
        step += 1
        finished += [(step, key) for key, _ in stream.step()]
    return finished


def test_admission_reserves_at_most_the_per_sample_reservation_so_unset_max_tokens_groups_decode_together(
    engine, samplers
):
    lora, _ = samplers
    context_rest = 2048 - len(PROMPT_C)  # max_tokens unset: up to the end of the tiny model's 2048 context
    stream = SampleStream(engine, budget_tokens=20_000)  # holds 2 of 7 + 8 × 1024, not 1 of 7 + 8 × 2041
    for index in range(3):
        stream.submit(f"group-{index}", lora, spec(PROMPT_C, seed=index, max_tokens=None, num_samples=8))
    stream.step()
    assert stream.stats.requests == 2 and 2 * (len(PROMPT_C) + 8 * context_rest) > 20_000


def test_requests_that_outgrow_the_budget_are_preempted_and_start_over_with_the_same_samples(engine, samplers):
    lora, _ = samplers
    budget = 150
    requests = {f"long-{i}": spec(PROMPT_C, seed=50 + i, max_tokens=40, num_samples=2) for i in range(3)}
    requests["unseeded"] = spec(PROMPT_B, seed=None, max_tokens=40, num_samples=2)
    # each reserves its prompt + 2 × 8 tokens, so all four are admitted; each grows to its prompt + 2 × 40
    stream = SampleStream(engine, budget_tokens=budget, reserved_tokens_per_sample=8)
    for key, request in requests.items():
        stream.submit(key, lora, request)
    results, peak = {}, 0
    while stream.busy:
        results.update(stream.step())
        peak = max(peak, stream.stored_columns)
    assert stream.stats.preempted >= 1 and stream.stats.requests == 4 + stream.stats.preempted
    assert peak <= 1.5 * budget  # the padding allowance of sample_stream.PADDING_ALLOWANCE
    for key, request in requests.items():
        assert [len(s.tokens) for s in results[key].sequences] == [40, 40]
        if request.seed is not None:
            assert_same(results[key], alone(engine, lora, request))


def test_a_bad_request_fails_alone_at_the_next_step(engine, samplers):
    lora, _ = samplers
    stream = engine.sample_stream()
    stream.submit("bad", lora, SampleSpec(prompt_tokens=(1, 10**6), max_tokens=2))
    stream.submit("unknown", "no-such-sampler", spec(PROMPT_C, seed=1))
    stream.submit("good", lora, spec(PROMPT_C, seed=1, max_tokens=2))
    results = run_to_end(stream)
    assert isinstance(results["bad"], EngineUserError) and "outside the vocabulary" in str(results["bad"])
    assert isinstance(results["unknown"], EngineUserError)
    assert len(results["good"].sequences[0].tokens) == 2


def next_turn(stream: SampleStream, sampler: str, prompt: tuple[int, ...], seed: int,
              num_samples: int = 1) -> tuple[SampleSpec, SampleResult]:
    request = spec(prompt, seed=seed, max_tokens=7, num_samples=num_samples)
    stream.submit(f"turn-{seed}", sampler, request)
    (result,) = run_to_end(stream).values()
    return request, result


def converse(stream: SampleStream, sampler: str, first: tuple[int, ...], observations: list[tuple[int, ...]],
             num_samples: int = 1) -> list[tuple[SampleSpec, SampleResult]]:
    """A multi-turn episode: each turn's prompt is the last prompt + its first sample's tokens + an observation."""
    turns = [next_turn(stream, sampler, first, 60, num_samples)]
    for seed, observation in enumerate(observations, start=61):
        request, result = turns[-1]
        prompt = request.prompt_tokens + tuple(result.sequences[0].tokens) + observation
        turns.append(next_turn(stream, sampler, prompt, seed, num_samples))
    return turns


def test_each_turn_of_a_conversation_prefills_only_what_the_last_turn_did_not_compute(engine, samplers):
    """Turn 2 reuses turn 1's prompt; turn 3 turn 2's prompt and completion (all but its last token)."""
    lora, _ = samplers
    first, observations = tuple(range(100, 140)), [(7, 8, 9, 10, 11), (12, 13, 14)]
    stream = engine.sample_stream()
    prefilled, reused = [], []
    turns = converse(stream, lora, first, [], num_samples=2)
    prefilled.append(stream.stats.prefill_tokens)
    for seed, observation in enumerate(observations, start=61):
        before = (stream.stats.prefill_tokens, stream.stats.reused_prefix_tokens)
        request, result = turns[-1]
        prompt = request.prompt_tokens + tuple(result.sequences[0].tokens) + observation
        turns.append(next_turn(stream, lora, prompt, seed, num_samples=2))
        prefilled.append(stream.stats.prefill_tokens - before[0])
        reused.append(stream.stats.reused_prefix_tokens - before[1])
    assert reused == [len(first), len(turns[1][0].prompt_tokens) + 7 - 1]
    assert prefilled == [len(first), 7 + 5, 1 + 3]
    for request, result in turns:
        assert_same(result, alone(engine, lora, request))


def test_a_conversation_samples_what_it_would_with_the_prefix_store_off(engine, samplers):
    lora, base = samplers
    first, observations = tuple(range(200, 237)), [(5, 6, 7), (8,), (9, 10)]
    for sampler in (lora, base):
        kept_stream, off_stream = engine.sample_stream(), SampleStream(engine, prefix_budget_tokens=0)
        kept = converse(kept_stream, sampler, first, observations)
        off = converse(off_stream, sampler, first, observations)
        assert kept_stream.stats.reused_prefix_tokens > 0
        assert off_stream.stats.reused_prefix_tokens == 0
        for (request, result), (request_off, result_off) in zip(kept, off):
            assert request.prompt_tokens == request_off.prompt_tokens
            assert_same(result, result_off)


def test_a_prompt_asking_for_prompt_logprobs_is_prefilled_whole(engine, samplers):
    lora, _ = samplers
    stream = engine.sample_stream()
    first = tuple(range(300, 340))
    stream.submit("first", lora, spec(first, seed=1))
    run_to_end(stream)
    request = spec(first + (1, 2, 3), seed=2, prompt_logprobs=True)
    stream.submit("with-logprobs", lora, request)
    (result,) = run_to_end(stream).values()
    assert stream.stats.reused_prefix_tokens == 0
    expected = alone(engine, lora, request)
    np.testing.assert_allclose(result.prompt_logprobs[1:], expected.prompt_logprobs[1:], atol=1e-5)


def test_progress_reports_each_samples_tokens_so_far_preempted_or_not(engine, samplers):
    """What streaming reads: every step's report is a prefix of the final samples (a preempted request
    starts over from its seed, so it reports the same tokens again), and it grows as the batch decodes."""
    lora, _ = samplers
    requests = {f"r{i}": spec(PROMPT_C, seed=70 + i, max_tokens=30, num_samples=2) for i in range(3)}
    stream = engine.sample_stream()
    stream.tuned = SampleStream(engine, budget_tokens=120, reserved_tokens_per_sample=8)
    for key, request in requests.items():
        stream.submit(key, lora, request)
    reports: dict[str, list[list[list[int]]]] = {key: [] for key in requests}
    results = {}
    while stream.busy:
        results.update(stream.step())
        for key in requests:
            if key not in results and (tokens := stream.progress(key)) is not None:
                reports[key].append(tokens)
    assert stream.tuned.stats.preempted >= 1
    for key, seen in reports.items():
        final = [s.tokens for s in results[key].sequences]
        assert len(seen) >= 10
        assert all(sample == whole[: len(sample)] for tokens in seen for sample, whole in zip(tokens, final))
        assert max(len(tokens[0]) for tokens in seen) == 29  # the last token arrives with the result
    assert stream.progress("r0") is None and stream.progress("never-submitted") is None
