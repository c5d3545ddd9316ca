"""Two real SDK clients against one localtinker: sampling and training share the engine fairly.

Each test floods the server from one client and checks that the other client's work finishes while the
flood is still running (before continuous batching and fair turns, it waited for the whole flood).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import tinker
from tinker import types

from tests.fixtures.server import LOCAL_API_KEY, TINY_MODEL

PROMPT = types.ModelInput.from_ints([1, 504, 2000, 31, 77])
# Long enough that the flood outlasts the 0.5 s head start plus the other client's work by seconds: with 150
# tokens (~0.9 s on the tiny model) the step finished 0.31-0.40 s before the flood locally, and once in CI
# 5 ms after it, within the SDK's result polling.
LONG = types.SamplingParams(max_tokens=600, seed=1, stop=[])


def _datum(length: int, offset: int = 0) -> types.Datum:
    tokens = [(7 * i + offset) % 5000 + 10 for i in range(length + 1)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length},
    )


def _finish_times(futures) -> list[float]:
    """Wall time at which each SDK future completed (waited on concurrently)."""

    def wait(future) -> float:
        future.result(timeout=300)
        return time.monotonic()

    with ThreadPoolExecutor(len(futures)) as pool:
        return list(pool.map(wait, futures))


def _second_client(tinker_server):
    return tinker.ServiceClient(base_url=tinker_server.base_url, api_key=LOCAL_API_KEY)


def test_a_training_step_is_not_starved_by_a_flood_of_samples(tinker_server, service_client) -> None:
    sampler = service_client.create_sampling_client(base_model=TINY_MODEL).result()
    other = _second_client(tinker_server)
    try:
        trainer = other.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=0).result()
        flood = [sampler.sample(PROMPT, num_samples=2, sampling_params=LONG) for _ in range(8)]
        with ThreadPoolExecutor(1) as pool:
            flood_done = pool.submit(_finish_times, flood)
            time.sleep(0.5)  # the flood is decoding
            trainer.forward_backward([_datum(32)], "cross_entropy").result(timeout=300)
            trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=300)
            step_done = time.monotonic()
            flood_finished = flood_done.result()
        assert step_done < min(flood_finished)  # the training step ran between decode steps
        assert all(len(s.tokens) == LONG.max_tokens for f in flood for s in f.result().sequences)
    finally:
        other.close("success").result(timeout=60)


def test_samples_are_not_starved_by_a_flood_of_training_ops(tinker_server, service_client) -> None:
    trainer = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=1).result()
    other = _second_client(tinker_server)
    try:
        sampler = other.create_sampling_client(base_model=TINY_MODEL).result()
        flood = [trainer.forward_backward([_datum(128, i) for _ in range(4)], "cross_entropy") for i in range(20)]
        time.sleep(0.3)
        sample = sampler.sample(PROMPT, num_samples=1, sampling_params=types.SamplingParams(max_tokens=8, seed=2, stop=[]))
        sample_done, *flood_finished = _finish_times([sample, *flood])
        assert sample_done < max(flood_finished)
    finally:
        other.close("success").result(timeout=60)


def test_a_short_request_of_another_run_does_not_wait_for_a_long_flood(tinker_server, service_client) -> None:
    run_a = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=2).result()
    flooding = run_a.save_weights_and_get_sampling_client().result()
    other = _second_client(tinker_server)
    try:
        run_b = other.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=3).result()
        run_b.forward_backward([_datum(16)], "cross_entropy")
        run_b.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=300)
        polite = run_b.save_weights_and_get_sampling_client().result()
        flood = [flooding.sample(PROMPT, num_samples=2, sampling_params=LONG) for _ in range(8)]
        time.sleep(0.5)
        short = polite.sample(PROMPT, num_samples=4, sampling_params=types.SamplingParams(max_tokens=5, seed=3, stop=[]))
        short_done, *flood_finished = _finish_times([short, *flood])
        assert short_done < min(flood_finished)
        assert [len(s.tokens) for s in short.result().sequences] == [5, 5, 5, 5]
    finally:
        other.close("success").result(timeout=60)
