"""The real tinker SDK against a real in-process localtinker (tiny model, float32): training clients."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.fixtures.server import TINY_MODEL

ADAM = types.AdamParams(learning_rate=1e-2)


def _datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": weights if weights is not None else [1.0] * (len(tokens) - 1),
        },
    )


def _logprobs(trainer: tinker.TrainingClient, data: list[types.Datum]) -> list[np.ndarray]:
    out = trainer.forward(data, "cross_entropy").result()
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def _step(trainer: tinker.TrainingClient, data: list[types.Datum]) -> float:
    loss = trainer.forward_backward(data, "cross_entropy")
    trainer.optim_step(ADAM)
    return loss.result().metrics["loss:sum"]


def test_lora_client_info_tokenizer_and_training(service_client: tinker.ServiceClient) -> None:
    trainer = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=0).result()
    info = trainer.get_info()
    assert (info.model_id, info.model_data.model_name, info.lora_rank) == (trainer.model_id, TINY_MODEL, 4)
    assert Path(info.model_data.tokenizer_id).is_dir()
    tokenizer = trainer.get_tokenizer()
    tokens = tokenizer.encode("The cat sat on the mat.")
    assert tokenizer.decode(tokens) == "The cat sat on the mat."
    data = [_datum(tokens)]
    losses = [_step(trainer, data) for _ in range(3)]
    assert losses[-1] < losses[0]
    fwd = trainer.forward(data, "cross_entropy").result()
    assert math.isclose(fwd.metrics["loss:sum"], -float(fwd.loss_fn_outputs[0]["logprobs"].to_numpy().sum()), rel_tol=1e-5)


def test_save_state_and_restore_with_and_without_optimizer(service_client: tinker.ServiceClient) -> None:
    trainer = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=1).result()
    data = [_datum([10, 20, 30, 40, 50, 60])]
    for _ in range(2):
        _step(trainer, data)
    path = trainer.save_state("two-steps").result().path
    assert path == f"tinker://{trainer.model_id}/weights/two-steps"
    probe = _logprobs(trainer, data)
    uninterrupted = [_step(trainer, data) for _ in range(2)]

    with_adam = service_client.create_training_client_from_state_with_optimizer(path).result()
    np.testing.assert_allclose(_logprobs(with_adam, data)[0], probe[0], atol=1e-6)
    np.testing.assert_allclose([_step(with_adam, data) for _ in range(2)], uninterrupted, rtol=1e-5)

    fresh_adam = service_client.create_training_client_from_state(path).result()
    np.testing.assert_allclose(_logprobs(fresh_adam, data)[0], probe[0], atol=1e-6)
    _step(fresh_adam, data)
    second = fresh_adam.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
    assert not math.isclose(second, uninterrupted[1], rel_tol=1e-6)  # Adam moments started from zero


def test_deprecated_in_place_load_state(service_client: tinker.ServiceClient) -> None:
    """TrainingClient.load_state / load_state_with_optimizer (deprecated by the SDK) load into the same client."""
    trainer = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=2).result()
    data = [_datum([11, 21, 31, 41, 51])]
    _step(trainer, data)
    path = trainer.save_state("one-step").result().path
    probe = _logprobs(trainer, data)
    continued = [_step(trainer, data) for _ in range(2)]
    with pytest.warns(FutureWarning):
        trainer.load_state_with_optimizer(path).result()
    np.testing.assert_allclose(_logprobs(trainer, data)[0], probe[0], atol=1e-6)
    np.testing.assert_allclose([_step(trainer, data) for _ in range(2)], continued, rtol=1e-5)
    with pytest.warns(FutureWarning):
        trainer.load_state(path).result()
    np.testing.assert_allclose(_logprobs(trainer, data)[0], probe[0], atol=1e-6)


def test_forward_backward_custom_with_a_dpo_loss(service_client: tinker.ServiceClient) -> None:
    trainer = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=2).result()
    prompt = [5, 6, 7]
    chosen, rejected = _datum(prompt + [100, 101], [0, 0, 1, 1]), _datum(prompt + [200, 201], [0, 0, 1, 1])
    pair = [chosen, rejected]
    reference = [lp.sum(where=np.array([0, 0, 1, 1], bool)) for lp in _logprobs(trainer, pair)]
    beta = 0.5

    def dpo_loss(data: list[types.Datum], logprobs: list[torch.Tensor]):
        weights = [torch.tensor(d.loss_fn_inputs["weights"].to_numpy()) for d in data]
        chosen_lp, rejected_lp = [(lp * w).sum() for lp, w in zip(logprobs, weights)]
        margin = beta * ((chosen_lp - reference[0]) - (rejected_lp - reference[1]))
        loss = -torch.nn.functional.logsigmoid(margin)
        return loss, {"dpo_margin:mean": float(margin.detach())}

    first = trainer.forward_backward_custom(pair, dpo_loss).result()
    assert math.isclose(first.metrics["loss:sum"], math.log(2), rel_tol=1e-4)  # policy == reference
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    after = trainer.forward_backward_custom(pair, dpo_loss).result()
    assert after.metrics["loss:sum"] < math.log(2) and after.metrics["dpo_margin:mean"] > 0


def test_checkpoint_ttl_is_listed_and_can_be_changed(service_client: tinker.ServiceClient) -> None:
    trainer = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=2, seed=3).result()
    expiring = trainer.save_state("expiring", ttl_seconds=7200).result().path
    kept = trainer.save_weights_for_sampler("kept").result().path
    rest = service_client.create_rest_client()

    def expiry() -> dict[str, float | None]:
        listed = rest.list_checkpoints(trainer.model_id).result().checkpoints
        return {c.tinker_path: None if c.expires_at is None else c.expires_at.timestamp() for c in listed}

    now = time.time()
    assert expiry()[kept] is None
    assert abs(expiry()[expiring] - (now + 7200)) < 120
    rest.set_checkpoint_ttl_from_tinker_path(kept, 3600).result()
    rest.set_checkpoint_ttl_from_tinker_path(expiring, None).result()
    assert expiry()[expiring] is None and abs(expiry()[kept] - (now + 3600)) < 120
