"""Bad requests through the real SDK against the real engine: a clear error, and nothing else breaks."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tinker
from tinker import types

from localtinker.server import RunningServer
from tests.fixtures.faults import out_of_memory_once
from tests.fixtures.server import LOCAL_API_KEY, TINY_MODEL

TOKENS = [7, 70, 700, 7000, 17]


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _logprobs(trainer: tinker.TrainingClient) -> np.ndarray:
    return trainer.forward([_datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def test_each_bad_request_names_the_problem_and_leaves_state_intact(service_client: tinker.ServiceClient) -> None:
    trainer = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=5).result()
    before = _logprobs(trainer)
    vocab = len(trainer.get_tokenizer())
    with pytest.raises(tinker.RequestFailedError, match=str(vocab + 10)) as failed:
        trainer.forward_backward([_datum([1, 2, vocab + 10])], "cross_entropy").result()
    assert failed.value.category == types.RequestErrorCategory.User
    mismatched = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0]}
    )
    with pytest.raises(tinker.BadRequestError, match="weights"):
        trainer.forward_backward([mismatched], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="AdamParams.learning_rate must be finite and >= 0, got -0.1"):
        trainer.optim_step(types.AdamParams(learning_rate=-0.1)).result()
    with pytest.raises(tinker.BadRequestError, match=r"AdamParams.eps must be finite and > 0 .*got 0.0"):
        trainer.optim_step(types.AdamParams(eps=0.0)).result()
    with pytest.raises(tinker.BadRequestError, match=r"ttl_seconds=60 must be .* between 3600"):
        trainer.save_state("short-lived", ttl_seconds=60).result()
    with pytest.raises(tinker.BadRequestError, match="stable_reinforce.*Supported losses: cross_entropy"):
        trainer.forward_backward([_datum(TOKENS)], "stable_reinforce").result()
    np.testing.assert_array_equal(_logprobs(trainer), before)  # nothing above touched the weights or gradients
    trainer.forward_backward([_datum(TOKENS)], "cross_entropy")
    assert trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics is not None
    with pytest.raises(Exception, match="no-such/model"):
        service_client.create_lora_training_client(base_model="no-such/model", rank=4).result()
    with pytest.raises(Exception, match="tinker://nowhere/weights/missing"):
        service_client.create_training_client_from_state("tinker://nowhere/weights/missing").result()


def test_two_concurrent_clients_do_not_interfere(tinker_server: RunningServer) -> None:
    def train(seed: int, tokens: list[int], results: dict[int, list[float]]) -> None:
        with tinker.ServiceClient(base_url=tinker_server.base_url, api_key=LOCAL_API_KEY) as client:
            trainer = client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=seed).result()
            losses = []
            for _ in range(2):
                loss = trainer.forward_backward([_datum(tokens)], "cross_entropy")
                trainer.optim_step(types.AdamParams(learning_rate=2e-2))
                losses.append(loss.result().metrics["loss:sum"])
            results[seed] = losses

    jobs = {11: [5, 50, 500, 5000], 12: [9, 99, 999, 9999, 9]}
    alone: dict[int, list[float]] = {}
    for seed, tokens in jobs.items():
        train(seed, tokens, alone)
    together: dict[int, list[float]] = {}
    threads = [threading.Thread(target=train, args=(seed, tokens, together)) for seed, tokens in jobs.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert together.keys() == alone.keys()
    for seed in jobs:
        np.testing.assert_allclose(together[seed], alone[seed], rtol=1e-6)


def test_running_out_of_memory_is_a_clear_user_error_and_the_server_goes_on(
    service_client: tinker.ServiceClient, monkeypatch
) -> None:
    """torch's OutOfMemoryError inside the engine reaches the SDK as a user error naming the work and what to
    send instead (not an internal error); the weights are untouched and the next requests run."""
    from localtinker.engine import decode_batch
    from localtinker.engine import engine as engine_module

    trainer = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=5).result()
    before = _logprobs(trainer)
    out_of_memory_once(monkeypatch, engine_module, "token_logprobs_tracking")
    with pytest.raises(tinker.RequestFailedError, match=r"forward_backward of 1 datums \(4 tokens\) ran out of cpu "
                                                        r"memory; nothing was changed\. Send fewer") as failed:
        trainer.forward_backward([_datum([3, 30, 300, 3000, 13])], "cross_entropy").result()  # not the kept forward's
    assert failed.value.category == types.RequestErrorCategory.User
    np.testing.assert_array_equal(_logprobs(trainer), before)
    sampler = trainer.save_weights_and_get_sampling_client("oom").result()
    out_of_memory_once(monkeypatch, decode_batch.DecodeBatch, "step")  # a decode step of the running batch
    params = types.SamplingParams(max_tokens=2, temperature=0.0)
    with pytest.raises(tinker.RequestFailedError, match=r"sampling 1 requests of one sampler ran out of cpu memory; "
                                                        r"nothing was changed\. Sample fewer") as failed:
        sampler.sample(types.ModelInput.from_ints(TOKENS), 1, params).result()
    assert failed.value.category == types.RequestErrorCategory.User
    assert len(sampler.sample(types.ModelInput.from_ints(TOKENS), 1, params).result().sequences[0].tokens) == 2
