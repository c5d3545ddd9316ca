"""Hosted Tinker through the same resource and SDK path. Opt-in only: needs network and a real key.

Run with `POSTTRAIN_REMOTE_TESTS=1 TINKER_API_KEY=tml-... .venv/bin/pytest -m remote`. Without a key the
SDK retries for minutes, so these never run by default or in CI (`addopts` deselects `remote`).
"""

from __future__ import annotations

import os

import pytest
from tinker import types

from resources.tinker import TinkerResource

pytestmark = pytest.mark.remote


@pytest.fixture
def hosted() -> TinkerResource:
    if os.environ.get("POSTTRAIN_REMOTE_TESTS") != "1" or not os.environ.get("TINKER_API_KEY"):
        pytest.fail("remote tests need POSTTRAIN_REMOTE_TESTS=1 and TINKER_API_KEY (they are opt-in: -m remote)")
    return TinkerResource(backend="remote", api_key=os.environ["TINKER_API_KEY"])


def test_hosted_service_trains_and_samples_a_lora_through_the_resource(hosted: TinkerResource) -> None:
    client = hosted.get_client()
    base_model = client.get_server_capabilities().supported_models[0].model_name
    training = client.create_lora_training_client(base_model=base_model, rank=8)
    tokenizer = training.get_tokenizer()
    tokens = tokenizer.encode("The capital of France is Paris.")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    losses = []
    for _ in range(3):
        result = training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        losses.append(result.metrics["loss:sum"])
    assert losses[-1] < losses[0]
    sampler = training.save_weights_and_get_sampling_client(name="posttrain-remote-test")
    sample = sampler.sample(
        types.ModelInput.from_ints(tokens[:4]), num_samples=1, sampling_params=types.SamplingParams(max_tokens=4)
    ).result()
    assert len(sample.sequences[0].tokens) >= 1
