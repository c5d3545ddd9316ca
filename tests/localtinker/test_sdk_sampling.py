"""The real tinker SDK against a real in-process localtinker (tiny model, float32): sampling clients."""

from __future__ import annotations

import numpy as np
import tinker
from tinker import types

from tests.fixtures.server import TINY_MODEL

PROMPT = types.ModelInput.from_ints([1, 504, 2000, 31, 77])


def _trained(service_client: tinker.ServiceClient, seed: int) -> tinker.TrainingClient:
    trainer = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=seed).result()
    tokens = [3, 14, 15, 92, 65, 35]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    trainer.forward_backward([datum], "cross_entropy")
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return trainer


def _forward_logprobs(trainer: tinker.TrainingClient, tokens: list[int]) -> np.ndarray:
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]})
    return trainer.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def test_named_sampler_weights_sample_deterministically_and_score_like_the_trainer(
    service_client: tinker.ServiceClient,
) -> None:
    trainer = _trained(service_client, seed=3)
    path = trainer.save_weights_for_sampler("sampler-a").result().path
    assert path == f"tinker://{trainer.model_id}/sampler_weights/sampler-a"
    sampler = service_client.create_sampling_client(model_path=path).result()
    assert sampler.get_base_model() == TINY_MODEL
    params = types.SamplingParams(max_tokens=6, seed=11, temperature=1.0, stop=[])
    first = sampler.sample(PROMPT, num_samples=3, sampling_params=params).result()
    again = sampler.sample(PROMPT, num_samples=3, sampling_params=params).result()
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    assert len(first.sequences) == 3 and all(len(s.tokens) == 6 and s.stop_reason == "length" for s in first.sequences)
    assert len({s.sequence_id for s in first.sequences}) == 3
    # Sampler logprobs of its own tokens equal the trainer's forward logprobs on the same sequence (float32).
    sequence = first.sequences[0]
    full = PROMPT.to_ints() + sequence.tokens
    trained = _forward_logprobs(trainer, full)
    np.testing.assert_allclose(sequence.logprobs, trained[-len(sequence.tokens) :], atol=1e-4)
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert scored[0] is None
    np.testing.assert_allclose(scored[1:], trained, atol=1e-4)


def test_ephemeral_and_base_model_samplers(service_client: tinker.ServiceClient) -> None:
    trainer = _trained(service_client, seed=4)
    current = trainer.save_weights_and_get_sampling_client().result()
    tokens = PROMPT.to_ints()
    np.testing.assert_allclose(
        current.compute_logprobs(PROMPT).result()[1:], _forward_logprobs(trainer, tokens), atol=1e-4
    )
    base = service_client.create_sampling_client(base_model=TINY_MODEL).result()
    base_scores = base.compute_logprobs(PROMPT).result()[1:]
    assert not np.allclose(base_scores, current.compute_logprobs(PROMPT).result()[1:], atol=1e-4)
    out = base.sample(PROMPT, num_samples=2, sampling_params=types.SamplingParams(max_tokens=3, seed=0)).result()
    assert len(out.sequences) == 2 and all(1 <= len(s.tokens) <= 3 for s in out.sequences)


def test_sampling_client_loads_its_tokenizer_by_model_name_offline(
    service_client: tinker.ServiceClient, smollm2_tokenizer
) -> None:
    # The SDK resolves a sampler's tokenizer by hub id; localtinker publishes it in the HF cache.
    sampler = service_client.create_sampling_client(base_model=TINY_MODEL)
    tokenizer = sampler.get_tokenizer()

    text = "<|im_start|>assistant\n12 + 7 = 19<|im_end|>"
    assert tokenizer.encode(text) == smollm2_tokenizer.encode(text)


def test_omitted_max_tokens_samples_until_eos_past_16_tokens(service_client: tinker.ServiceClient) -> None:
    """SamplingParams.max_tokens defaults to None (no cap but the context). The model is taught to put ~5%
    on EOS after its own samples, so answers have geometric lengths; unmodified SamplingParams then run
    each answer until EOS (stop_reason "stop"), some past 16 tokens, the cap localtinker used to impose."""
    trainer = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=8, seed=1).result()
    eos = trainer.get_tokenizer().eos_token_id
    own = trainer.save_weights_and_get_sampling_client().result()
    samples = own.sample(PROMPT, num_samples=4, sampling_params=types.SamplingParams(max_tokens=40, seed=1)).result()
    prompt = PROMPT.to_ints()
    eos_after_own_samples = [
        types.Datum(
            model_input=types.ModelInput.from_ints((prompt + s.tokens)[:-1]),
            loss_fn_inputs={
                "target_tokens": [eos] * (len(prompt) + len(s.tokens) - 1),
                "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(s.tokens),
            },
        )
        for s in samples.sequences
    ]

    def mean_eos_probability() -> float:
        outputs = trainer.forward(eos_after_own_samples, "cross_entropy").result().loss_fn_outputs
        return float(np.mean([np.exp(o["logprobs"].to_numpy()[len(prompt) - 1 :]).mean() for o in outputs]))

    for _ in range(40):
        if mean_eos_probability() >= 0.05:
            break
        trainer.forward_backward(eos_after_own_samples, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=3e-3))
    assert 0.05 <= mean_eos_probability() < 0.2
    sampler = trainer.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(seed=5)
    assert params.max_tokens is None
    result = sampler.sample(PROMPT, num_samples=8, sampling_params=params).result()
    assert all(s.stop_reason == "stop" and s.tokens[-1] == eos for s in result.sequences)
    assert max(len(s.tokens) for s in result.sequences) > 16


def test_a_conversation_through_the_sdk_reuses_its_earlier_turns_and_still_scores_like_the_trainer(
    tinker_server, service_client: tinker.ServiceClient
) -> None:
    """Each turn sends the whole conversation; the server prefills only what it has not computed before."""
    trainer = _trained(service_client, seed=5)
    sampler = trainer.save_weights_and_get_sampling_client().result()
    stats = tinker_server.service.worker.sampling_stats
    reused_before = stats.reused_prefix_tokens
    conversation = list(range(600, 640))
    params = types.SamplingParams(max_tokens=5, seed=21, temperature=1.0, stop=[])
    for observation in ([], [3, 4, 5], [6, 7]):
        conversation += observation
        prompt = types.ModelInput.from_ints(conversation)
        sequence = sampler.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0]
        full = conversation + sequence.tokens
        trained = _forward_logprobs(trainer, full)[-len(sequence.tokens) :]
        np.testing.assert_allclose(sequence.logprobs, trained, atol=1e-4)
        conversation = full
    # turn 2 reuses turn 1's 40-token prompt; turn 3 turn 2's 48-token prompt and 4 of its 5 sampled tokens
    assert stats.reused_prefix_tokens - reused_before == 40 + 48 + 4
