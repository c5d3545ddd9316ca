"""Batched KV-cached sampling: logprob agreement with the trainer, seeds, stops, prompt logprobs, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localtinker.engine.api import AdamSpec, DatumArrays, EngineUserError, LoraSpec, SampleSpec
from localtinker.engine.decode_batch import shared_prefix_length
from localtinker.engine.sampler import SampleRow, _inverse_cdf, choose_tokens
from tests.localtinker.engine.reference import TINY, ReferenceModel, sft_datum


@pytest.fixture(scope="module")
def trained(engine):
    """A trained LoRA model (non-trivial adapter) with an ephemeral sampler ``trained-sampler`` over it."""
    model_id = "sampler:train:0"
    engine.create_model(model_id, TINY, LoraSpec(rank=4, seed=1))
    rng = np.random.default_rng(0)
    for _ in range(2):
        engine.forward_backward(model_id, [sft_datum(rng, 16)], "cross_entropy", None, False)
        engine.optim_step(model_id, AdamSpec(learning_rate=0.05))
    engine.create_ephemeral_sampler("trained-sampler", model_id)
    engine.create_sampler("base-sampler", TINY, None)
    return model_id


def forward_logprobs(engine, model_id: str, prompt, completion) -> np.ndarray:
    full = list(prompt) + list(completion)
    datum = DatumArrays(tokens=np.array(full[:-1]), loss_fn_inputs={"target_tokens": np.array(full[1:])})
    return engine.forward_backward(model_id, [datum], "cross_entropy", None, True).loss_fn_outputs[0]["logprobs"]


def test_sampler_logprobs_equal_forward_logprobs(engine, trained):
    specs = [
        SampleSpec(prompt_tokens=(10, 20, 30), num_samples=3, max_tokens=6, seed=1),
        SampleSpec(prompt_tokens=tuple(range(100, 117)), num_samples=2, max_tokens=9, seed=2, top_k=50),
        SampleSpec(prompt_tokens=(7,), max_tokens=4, seed=3, top_p=0.5),
    ]
    results = engine.sample_batch([("trained-sampler", spec) for spec in specs])
    worst = 0.0
    for spec, result in zip(specs, results):
        assert len(result.sequences) == spec.num_samples
        for sequence in result.sequences:
            assert len(sequence.tokens) == spec.max_tokens and sequence.stop_reason == "length"
            learner = forward_logprobs(engine, trained, spec.prompt_tokens, sequence.tokens)[-spec.max_tokens :]
            worst = max(worst, float(np.abs(learner - np.array(sequence.logprobs)).max()))
    assert worst < 1e-4


def test_temperature_scaled_logprobs_match_reference(engine, trained):
    spec = SampleSpec(prompt_tokens=(3, 4, 5, 6), max_tokens=5, temperature=0.5, seed=4)
    sequence = engine.sample_batch([("trained-sampler", spec)])[0].sequences[0]
    reference = ReferenceModel(engine.lora_spec(trained), engine.lora_weights(trained))
    full = list(spec.prompt_tokens) + sequence.tokens
    with torch.no_grad():
        expected = reference.logprobs(np.array(full[:-1]), np.array(full[1:]), temperature=0.5)[-5:]
    np.testing.assert_allclose(sequence.logprobs, expected.numpy(), atol=1e-4)


def test_prompt_logprobs_start_with_none_and_match_forward(engine, trained):
    prompt = tuple(range(200, 212))
    result = engine.sample_batch([("trained-sampler", SampleSpec(prompt_tokens=prompt, max_tokens=1, prompt_logprobs=True))])[0]
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt)
    learner = forward_logprobs(engine, trained, prompt, [])
    np.testing.assert_allclose(result.prompt_logprobs[1:], learner, atol=1e-4)


def test_same_seed_same_samples_whatever_the_batch(engine, trained):
    spec = SampleSpec(prompt_tokens=(11, 12, 13), num_samples=2, max_tokens=8, seed=123)
    alone = engine.sample_batch([("trained-sampler", spec)])[0]
    crowd = engine.sample_batch(
        [("trained-sampler", SampleSpec(prompt_tokens=tuple(range(300, 320)), max_tokens=3)), ("trained-sampler", spec)]
    )[1]
    other_seed = engine.sample_batch([("trained-sampler", SampleSpec(prompt_tokens=(11, 12, 13), num_samples=2, max_tokens=8, seed=124))])[0]
    tokens = [s.tokens for s in alone.sequences]
    assert tokens == [s.tokens for s in crowd.sequences]
    assert tokens[0] != tokens[1]  # the samples of one request differ
    assert tokens != [s.tokens for s in other_seed.sequences]
    unseeded = [engine.sample_batch([("trained-sampler", SampleSpec(prompt_tokens=(11, 12, 13), max_tokens=8))])[0] for _ in range(2)]
    assert unseeded[0].sequences[0].tokens != unseeded[1].sequences[0].tokens


def greedy(engine, sampler: str, prompt, n: int, **kwargs):
    return engine.sample_batch([(sampler, SampleSpec(prompt_tokens=prompt, max_tokens=n, temperature=0.0, **kwargs))])[0].sequences[0]


def test_stop_token_ids(engine, trained):
    prompt = (40, 41, 42)
    free = greedy(engine, "trained-sampler", prompt, 6, stop_token_ids=())
    assert len(free.tokens) == 6 and free.stop_reason == "length"
    stopped = greedy(engine, "trained-sampler", prompt, 6, stop_token_ids=(free.tokens[2],))
    assert stopped.tokens == free.tokens[: free.tokens.index(free.tokens[2]) + 1] and stopped.stop_reason == "stop"


def test_stop_strings_stop_after_the_matching_token(engine, tokenizer_for_tiny, trained):
    prompt = (50, 51, 52)
    free = greedy(engine, "trained-sampler", prompt, 6, stop_token_ids=())
    texts = [tokenizer_for_tiny.decode(free.tokens[: i + 1]) for i in range(6)]
    cut = next(i for i in range(2, 6) if texts[i] != texts[i - 1] and texts[i][len(texts[i - 1]):].strip())
    stop_text = texts[cut][len(texts[cut - 1]) :].strip()[:3]
    first_hit = next(i for i in range(6) if stop_text in texts[i])
    stopped = greedy(engine, "trained-sampler", prompt, 6, stop_token_ids=(), stop_strings=(stop_text,))
    assert stopped.tokens == free.tokens[: first_hit + 1] and stopped.stop_reason == "stop"


def test_eos_stops_by_default_but_not_with_empty_stop_ids(engine):
    """A model whose LoRA makes EOS overwhelmingly likely: default stops at once, stop_token_ids=() runs on."""
    model_id = "sampler:train:eos"
    engine.create_model(model_id, TINY, LoraSpec(rank=4, seed=2))
    eos = engine._hosts[TINY].base.eos_token_ids[0]  # noqa: SLF001
    tokens = np.array([5, 6, 7, 8, 9, 10])
    datum = DatumArrays(tokens=tokens, loss_fn_inputs={"target_tokens": np.full(6, eos), "weights": np.ones(6, np.float32)})
    for _ in range(15):
        engine.forward_backward(model_id, [datum], "cross_entropy", None, False)
        engine.optim_step(model_id, AdamSpec(learning_rate=0.05))
    engine.create_ephemeral_sampler("eos-sampler", model_id)
    default = greedy(engine, "eos-sampler", (5, 6, 7), 5)
    assert default.tokens == [eos] and default.stop_reason == "stop"
    assert greedy(engine, "eos-sampler", (5, 6, 7), 5, stop_token_ids=()).tokens == [eos] * 5


def test_base_sampler_ignores_adapters(engine, trained):
    prompt = (60, 61, 62)
    base = greedy(engine, "base-sampler", prompt, 4, stop_token_ids=())
    lora = greedy(engine, "trained-sampler", prompt, 4, stop_token_ids=())
    learner = forward_logprobs(engine, trained, prompt, base.tokens)[-4:]
    assert not np.allclose(learner, base.logprobs, atol=1e-4)  # the adapter matters ...
    base_again = greedy(engine, "base-sampler", prompt, 4, stop_token_ids=())
    assert base_again.logprobs == base.logprobs and lora.logprobs != base.logprobs  # ... and is switched off


@pytest.mark.parametrize(
    "spec,message",
    [
        (SampleSpec(prompt_tokens=()), "prompt is empty"),
        (SampleSpec(prompt_tokens=(1, 49152)), "outside the vocabulary"),
        (SampleSpec(prompt_tokens=(1,), max_tokens=-1), "max_tokens"),
        (SampleSpec(prompt_tokens=(1,), max_tokens=2048), "exceeds the model context"),
        (SampleSpec(prompt_tokens=(1,), temperature=-1), "temperature"),
        (SampleSpec(prompt_tokens=(1,), top_p=0.0), "top_p"),
        (SampleSpec(prompt_tokens=(1,), num_samples=0), "num_samples"),
        (SampleSpec(prompt_tokens=(1,), stop_token_ids=(99999,)), "stop token id"),
    ],
)
def test_bad_sample_requests_fail_alone(engine, trained, spec, message):
    good = SampleSpec(prompt_tokens=(1, 2), max_tokens=2, seed=0)
    bad_result, good_result = engine.sample_batch([("trained-sampler", spec), ("trained-sampler", good)])
    assert isinstance(bad_result, EngineUserError) and message in str(bad_result)
    assert len(good_result.sequences[0].tokens) == 2


def test_unknown_sampler_is_an_error_result(engine):
    (result,) = engine.sample_batch([("nobody", SampleSpec(prompt_tokens=(1,)))])
    assert isinstance(result, EngineUserError) and "unknown sampling session" in str(result)


def test_shared_prompt_prefix_is_prefilled_once_and_stays_exact(engine, trained):
    system = tuple(range(500, 512))
    specs = [
        SampleSpec(prompt_tokens=system + (1, 2, 3), num_samples=2, max_tokens=5, seed=1, prompt_logprobs=True),
        SampleSpec(prompt_tokens=system + (7,), max_tokens=6, seed=2, prompt_logprobs=True),
        SampleSpec(prompt_tokens=system + tuple(range(30, 40)), max_tokens=4, seed=3),
    ]
    assert shared_prefix_length([s.prompt_tokens for s in specs]) == len(system)
    results = engine.sample_batch([("trained-sampler", spec) for spec in specs])
    for spec, result in zip(specs, results):
        for sequence in result.sequences:
            learner = forward_logprobs(engine, trained, spec.prompt_tokens, sequence.tokens)
            np.testing.assert_allclose(sequence.logprobs, learner[-len(sequence.tokens) :], atol=1e-4)
            if spec.prompt_logprobs:
                np.testing.assert_allclose(result.prompt_logprobs[1:], learner[: len(spec.prompt_tokens) - 1], atol=1e-4)
    alone = engine.sample_batch([("trained-sampler", specs[1])])[0]
    assert alone.sequences[0].tokens == results[1].sequences[0].tokens


def test_shared_prefix_length_leaves_every_prompt_a_token():
    assert shared_prefix_length([tuple(range(20)), tuple(range(20))]) == 19
    assert shared_prefix_length([tuple(range(20)), tuple(range(5))]) == 0  # below the minimum worth sharing
    assert shared_prefix_length([tuple(range(20))]) == 0
    assert shared_prefix_length([tuple(range(12)) + (1,), tuple(range(12)) + (2, 3)]) == 12


def _row(**kwargs) -> SampleRow:
    params = dict(request=0, max_tokens=1, temperature=1.0, top_k=-1, top_p=1.0, stop_ids=frozenset(), stop_strings=())
    params.update(kwargs)
    return SampleRow(generator=torch.Generator(), **params)


@pytest.mark.parametrize("max_tokens", [1, 3, 300, 600])
def test_a_rows_uniforms_are_its_generators_scalar_draws_in_order(max_tokens):
    """Uniforms are drawn ahead a block at a time (at most the row's budget, at most 256): the row still gets
    exactly the scalar draws its seed gives, in order, across refills and past its budget (the queued GPU step
    draws one more for a row that has just finished)."""
    row = _row(max_tokens=max_tokens)
    row.generator.manual_seed(42)
    reference = torch.Generator().manual_seed(42)
    for step in range(max_tokens + 5):
        assert row.next_uniform() == torch.rand((), generator=reference).item(), step
        row.tokens.append(0)


def test_top_k_and_top_p_restrict_the_candidates_but_not_the_reported_logprob():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    rows = [_row(top_k=2) for _ in range(200)] + [_row(top_p=0.65) for _ in range(200)] + [_row() for _ in range(400)]
    for index, row in enumerate(rows):
        row.generator.manual_seed(index)
    tokens, logprobs = choose_tokens(logits.expand(len(rows), 4).clone(), rows)
    assert set(tokens[:400].tolist()) == {0, 1}  # top-2, and top-p 0.65 keeps {0.4, 0.3}
    assert set(tokens[400:].tolist()) == {0, 1, 2, 3}
    np.testing.assert_allclose(logprobs.numpy(), logits[tokens].numpy(), atol=1e-6)  # unfiltered distribution
    frequencies = np.bincount(tokens[400:].numpy(), minlength=4) / 400
    np.testing.assert_allclose(frequencies, [0.4, 0.3, 0.2, 0.1], atol=0.07)


@pytest.mark.parametrize("vocab", [49152, 50001, 1000, 3])
def test_the_blocked_inverse_cdf_picks_what_a_full_cumulative_sum_picks_and_never_a_zero_weight(vocab):
    generator = torch.Generator().manual_seed(vocab)
    weights = torch.rand(64, vocab, generator=generator) ** 8
    weights[:, 1::3] = 0.0  # filtered tokens (top-k/top-p leave zeros)
    uniforms = torch.rand(64, generator=generator)
    uniforms[:4] = torch.tensor([0.0, 1e-9, 1 - 2**-24, 1 - 2**-24])  # both ends of the draw
    reference = torch.searchsorted(  # in float64, with one full cumulative sum per row
        weights.double().cumsum(-1), (uniforms.double() * weights.double().sum(-1))[:, None], right=True
    ).squeeze(-1).clamp(max=vocab - 1)
    tokens = _inverse_cdf(weights, uniforms)
    assert (weights.gather(-1, tokens[:, None]) > 0).all()
    # float32 sums in another order than one float64 cumulation: a draw within rounding of a step's edge may
    # land on the neighbouring non-zero token (here 1 row of 60 at most; a float32 full cumsum does the same)
    differ = (tokens != reference).nonzero().squeeze(-1)
    assert len(differ[differ >= 4]) <= 2 and ((tokens - reference).abs()[differ] <= 2).all()


def test_sampled_frequencies_follow_the_weights_across_blocks():
    weights = torch.zeros(1, 3000)
    weights[0, [0, 1, 1500, 2999]] = torch.tensor([1.0, 2.0, 5.0, 2.0])
    generator = torch.Generator().manual_seed(0)
    tokens = _inverse_cdf(weights.expand(40000, -1), torch.rand(40000, generator=generator))
    frequencies = torch.bincount(tokens, minlength=3000)[[0, 1, 1500, 2999]].double() / 40000
    np.testing.assert_allclose(frequencies.numpy(), [0.1, 0.2, 0.5, 0.2], atol=0.01)
    assert torch.bincount(tokens, minlength=3000).sum() == 40000 and set(tokens.unique().tolist()) == {0, 1, 1500, 2999}
