"""Custom losses through the real SDK: client-side forward_backward_custom, and ServiceClient.create_custom_loss
(SDK 0.38, alpha), which localtinker runs client-side by advertising custom_loss_server_side=false."""

from __future__ import annotations

import httpx
import pytest
import tinker
import torch
from tinker import types

import localtinker.engine.engine as engine_module
from localtinker.server import RunningServer
from tests.fixtures.server import LOCAL_API_KEY, TINY_MODEL

SEQUENCES = ([5, 6, 7, 100, 101, 102], [9, 8, 300, 301])


def _data() -> list[types.Datum]:
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": tokens[1:],
                "advantages": [0.5 * (i + 1) for i in range(len(tokens) - 1)],
            },
        )
        for tokens in SEQUENCES
    ]


def _grads_of(server: RunningServer, trainer: tinker.TrainingClient) -> dict[str, torch.Tensor]:
    """The gradient the last forward_backward accumulated, then cleared by a zero-LR optim_step."""
    grads = server.engine.lora_grads(trainer.model_id)
    trainer.optim_step(types.AdamParams(learning_rate=0.0)).result()
    return grads


def _analytic_grads(server: RunningServer, trainer: tinker.TrainingClient, data: list[types.Datum]):
    """∇ Σ_t A_t·lp_t² = Σ_t 2·A_t·lp_t·∇lp_t: cross_entropy (loss −Σ w·lp) with w = −2·A·lp."""
    logprobs = [o["logprobs"].to_numpy() for o in trainer.forward(data, "cross_entropy").result().loss_fn_outputs]
    weighted = [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "weights": (-2.0 * d.loss_fn_inputs["advantages"].to_numpy() * lp).tolist(),
            },
        )
        for d, lp in zip(data, logprobs)
    ]
    trainer.forward_backward(weighted, "cross_entropy").result()
    expected_loss = sum(float((d.loss_fn_inputs["advantages"].to_numpy() * lp**2).sum()) for d, lp in zip(data, logprobs))
    return expected_loss, _grads_of(server, trainer)


def _assert_same_grads(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    assert any(float(grad.abs().max()) > 0 for grad in expected.values())  # (lora_A gets none while B = 0)
    for key, grad in expected.items():
        torch.testing.assert_close(actual[key], grad, rtol=1e-4, atol=1e-7, msg=key)


def test_client_side_custom_loss_gradient_equals_the_analytic_one(
    service_client: tinker.ServiceClient, tinker_server: RunningServer
) -> None:
    trainer = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=7).result()
    data = _data()

    def squared_logprobs(batch: list[types.Datum], logprobs: list[torch.Tensor]):
        loss = sum((d.loss_fn_inputs["advantages"].to_torch() * lp**2).sum() for d, lp in zip(batch, logprobs))
        return loss, {"custom/squared:sum": float(loss.detach())}

    result = trainer.forward_backward_custom(data, squared_logprobs).result()
    custom = _grads_of(tinker_server, trainer)
    expected_loss, analytic = _analytic_grads(tinker_server, trainer, data)
    assert result.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-5)
    _assert_same_grads(custom, analytic)


def test_the_custom_loss_backward_reuses_the_forward_pass_with_the_same_gradient(
    service_client: tinker.ServiceClient, tinker_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the SDK's reserved request ids: the forward's graph is kept and its backward needs no second forward."""
    trainer = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=9).result()
    sft = [
        types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                                                               "weights": [1.0] * d.model_input.length})
        for d in _data()
    ]
    trainer.forward_backward(sft, "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=0.05)).result()  # B != 0
    decoder = tinker_server.engine._hosts[TINY_MODEL].base.model.get_decoder()
    passes: list[int] = []
    handle = decoder.register_forward_hook(lambda *args: passes.append(1))

    def squared_logprobs(batch: list[types.Datum], logprobs: list[torch.Tensor]):
        return sum((d.loss_fn_inputs["advantages"].to_torch() * lp**2).sum() for d, lp in zip(batch, logprobs)), {}

    try:
        kept = trainer.forward_backward_custom(_data(), squared_logprobs).result()
        kept_grads, kept_passes = _grads_of(tinker_server, trainer), len(passes)
        monkeypatch.setattr(engine_module, "RETAIN_FORWARDS", False)
        passes.clear()
        recomputed = trainer.forward_backward_custom(_data(), squared_logprobs).result()
        recomputed_grads = _grads_of(tinker_server, trainer)
    finally:
        handle.remove()
    assert kept_passes == 1 and len(passes) == 2  # one micro-batch: one forward instead of two
    assert kept.metrics["loss:sum"] == pytest.approx(recomputed.metrics["loss:sum"], rel=1e-6)
    _assert_same_grads(kept_grads, recomputed_grads)


def test_concurrent_custom_losses_of_two_clients_get_their_own_gradients(
    service_client: tinker.ServiceClient, tinker_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two clients' forward/backward pairs interleave on the one worker; a kept forward serves only its own."""
    from concurrent.futures import ThreadPoolExecutor

    def squared_logprobs(batch: list[types.Datum], logprobs: list[torch.Tensor]):
        return sum((d.loss_fn_inputs["advantages"].to_torch() * lp**2).sum() for d, lp in zip(batch, logprobs)), {}

    trainers = [service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=s).result() for s in (11, 12)]
    for trainer in trainers:  # B != 0, and different weights per client
        trainer.forward_backward_custom(_data(), squared_logprobs).result()
        trainer.optim_step(types.AdamParams(learning_rate=0.05)).result()

    def three_steps(trainer: tinker.TrainingClient) -> list[dict[str, torch.Tensor]]:
        grads = []
        for _ in range(3):
            trainer.forward_backward_custom(_data(), squared_logprobs).result()
            grads.append(_grads_of(tinker_server, trainer))  # a zero-LR step: the weights stay
        return grads

    with ThreadPoolExecutor(2) as pool:
        concurrent = list(pool.map(three_steps, trainers))
    monkeypatch.setattr(engine_module, "RETAIN_FORWARDS", False)
    for trainer, got in zip(trainers, concurrent):
        expected = three_steps(trainer)[0]
        for grads in got:
            _assert_same_grads(grads, expected)


def test_create_custom_loss_runs_client_side_with_the_analytic_gradient(
    service_client: tinker.ServiceClient, tinker_server: RunningServer
) -> None:
    def squared_logprobs(logprobs, advantages):
        loss = (advantages * logprobs * logprobs).sum()
        return loss, {"custom/squared:sum": loss}

    handle = service_client.create_custom_loss(squared_logprobs, input_ranks={"logprobs": 1, "advantages": 1}).result()
    assert handle.loss_id is None  # not uploaded: the server said custom_loss_server_side=false
    trainer = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=8).result()
    data = _data()
    result = trainer.forward_backward_custom(data, handle).result()
    traced = _grads_of(tinker_server, trainer)
    expected_loss, analytic = _analytic_grads(tinker_server, trainer, data)
    assert result.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-5)
    assert result.metrics["custom/squared:sum"] == pytest.approx(expected_loss, rel=1e-5)
    _assert_same_grads(traced, analytic)


def test_uploading_a_custom_loss_graph_is_refused_clearly(tinker_server: RunningServer) -> None:
    """An SDK told to upload anyway (or a hand-made request) gets a 400 that says what to do instead."""
    response = httpx.post(
        f"{tinker_server.base_url}/api/v1/create_custom_loss",
        headers={"X-API-Key": LOCAL_API_KEY},
        json={"session_id": "s", "custom_loss_seq_id": 0, "name": "f", "inputs": [], "graph": {"nodes": []}},
    )
    assert response.status_code == 400
    assert "custom_loss_server_side" in response.json()["error"] and "client-side" in response.json()["error"]
    config = httpx.post(
        f"{tinker_server.base_url}/api/v1/client/config", headers={"X-API-Key": LOCAL_API_KEY}, json={"sdk_version": "0.38.0"}
    ).json()
    assert config["custom_loss_server_side"] is False
