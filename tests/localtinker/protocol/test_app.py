"""The protocol layer against a fake engine, driven by the real tinker SDK and by raw HTTP."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from localtinker.protocol.app import ProtocolConfig
from localtinker.server import RunningServer, start_server

from .fake_engine import BASE_MODEL, VOCAB, FakeEngine

KEY = "tml-local"


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    storage = tmp_path_factory.mktemp("fake-storage")
    config = ProtocolConfig(
        long_poll_s=0.3,
        max_request_bytes=1_000_000,
        client_config={"fwdbwd_max_chunk_len": 2, "proto_compress_fwdbwd": True},  # small chunks, zstd bodies
    )
    with start_server(storage, engine=FakeEngine(storage), config=config) as server:
        yield server


@pytest.fixture
def client(fake_server: RunningServer) -> Iterator[tinker.ServiceClient]:
    service = tinker.ServiceClient(base_url=fake_server.base_url, api_key=KEY)
    yield service
    service.close("success").result(timeout=30)


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _post(server: RunningServer, path: str, **kwargs) -> httpx.Response:
    headers = {"X-API-Key": KEY, **kwargs.pop("headers", {})}
    return httpx.post(f"{server.base_url}/api/v1/{path}", headers=headers, timeout=10, **kwargs)


def test_chunks_sent_in_parallel_run_in_seq_order(fake_server: RunningServer, client: tinker.ServiceClient) -> None:
    trainer = client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    data = [_datum([i, i + 1, i + 2]) for i in range(1, 6)]  # 5 datums, 2 per chunk -> 3 parallel chunks
    result = trainer.forward_backward(data, "cross_entropy").result()
    calls = [c[2] for c in fake_server.engine.calls if c[0] == "forward_backward" and c[1] == trainer.model_id]
    assert calls == [[[1, 2], [2, 3]], [[3, 4], [4, 5]], [[5, 6]]]
    single = [trainer.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist() for d in data]
    assert [o["logprobs"].tolist() for o in result.loss_fn_outputs] == single


def test_training_through_the_sdk_and_exact_resume_with_optimizer(client: tinker.ServiceClient) -> None:
    trainer = client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    batch, adam = [_datum([3, 4, 5, 6])], types.AdamParams(learning_rate=0.05)

    def step(t) -> float:
        loss = t.forward_backward(batch, "cross_entropy")
        t.optim_step(adam).result()
        return loss.result().metrics["loss:sum"]

    first = [step(trainer) for _ in range(3)]
    assert first[2] < first[0]
    path = trainer.save_state("after-3").result().path
    continued = [step(trainer) for _ in range(2)]
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    assert [step(resumed) for _ in range(2)] == continued
    fresh_optimizer = client.create_training_client_from_state(path).result()
    assert [step(fresh_optimizer) for _ in range(2)] != continued
    assert resumed.get_info().model_data.model_name == BASE_MODEL


def test_sampling_batches_concurrent_requests_and_matches_trainer_logprobs(
    fake_server: RunningServer, client: tinker.ServiceClient
) -> None:
    trainer = client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    trainer.forward_backward([_datum([1, 2, 3])], "cross_entropy")
    trainer.optim_step(types.AdamParams(learning_rate=0.1)).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    fake_server.engine.sample_batch_sizes.clear()
    release = threading.Event()
    held = fake_server.service.worker.call("hold the worker", lambda engine: release.wait(30))
    params = types.SamplingParams(max_tokens=4, seed=3, stop=[])
    futures = [sampler.sample(types.ModelInput.from_ints([1, 2]), 3, params) for _ in range(6)]
    deadline = time.monotonic() + 30
    while fake_server.service.worker.queue_depth()["samples"] < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    held.result(timeout=30)
    responses = [f.result() for f in futures]
    assert all(len(r.sequences) == 3 for r in responses)
    assert len({s.sequence_id for r in responses for s in r.sequences}) == 18
    assert fake_server.engine.sample_batch_sizes == [6]  # queued while the worker was busy: one engine call
    prompt = [4, 9, 2, 7]
    sampled = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    trained = trainer.forward([_datum(prompt)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert sampled[0] is None
    assert np.allclose(sampled[1:], trained, atol=1e-5)


def test_refused_requests_do_not_stall_or_corrupt_the_client(client: tinker.ServiceClient) -> None:
    trainer = client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    probe = [_datum([2, 3, 4])]
    before = trainer.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    with pytest.raises(tinker.BadRequestError, match=r"AdamParams.beta1 must be finite and in \[0, 1\), got 1.5"):
        trainer.optim_step(types.AdamParams(beta1=1.5)).result()
    with pytest.raises(tinker.BadRequestError, match="stable_reinforce.*cross_entropy, importance_sampling"):
        trainer.forward_backward(probe, "stable_reinforce").result()
    mismatched = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]}
    )
    with pytest.raises(tinker.BadRequestError, match="has shape \\[2\\] but model_input has 3 tokens"):
        trainer.forward_backward([mismatched], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="outside the vocab") as failure:
        trainer.forward_backward([_datum([1, VOCAB + 5, 2])], "cross_entropy").result()
    assert failure.value.category == tinker.types.RequestErrorCategory.User
    # zstd-compressed here: ~1 KB on the wire that inflates past the 1 MB limit, refused before it is parsed.
    with pytest.raises(tinker.APIStatusError, match="inflates to more than 1000000 bytes"):
        trainer.forward_backward([_datum([5] * 300_000)], "cross_entropy").result()
    # Every refusal above took a seq_id; later requests of the same client still run, on intact state,
    # without waiting the server's 60 s gap timeout for a seq_id that will never come.
    assert trainer.forward(probe, "cross_entropy").result(timeout=20).loss_fn_outputs[0]["logprobs"].tolist() == before
    trainer.forward_backward(probe, "cross_entropy")
    assert trainer.optim_step(types.AdamParams(learning_rate=0.1)).result().metrics["step"] == 1.0


def test_malformed_http_gets_4xx_that_says_what_is_wrong(fake_server: RunningServer) -> None:
    proto = {"Content-Type": "application/x-protobuf"}
    bad = _post(fake_server, "forward_backward", content=b"\x0a\xff\xff garbage", headers=proto)
    assert bad.status_code == 400 and "not a valid tinker ForwardBackwardRequest" in bad.json()["error"]
    as_json = _post(fake_server, "forward_backward", json={"model_id": "x"})
    assert as_json.status_code == 415 and "protobuf" in as_json.json()["error"]
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[_datum([1, 2, 3])], loss_fn="cross_entropy"),
        model_id="no-such-session:train:0",
        seq_id=1,
    )
    unknown = _post(fake_server, "forward_backward", content=forward_backward_request_to_proto(request).SerializeToString(), headers=proto)
    assert unknown.status_code == 404 and "unknown model_id 'no-such-session:train:0'" in unknown.json()["error"]
    not_json = _post(fake_server, "optim_step", content=b"{not json", headers={"Content-Type": "application/json"})
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]
    too_big = _post(fake_server, "telemetry", content=b"x" * 1_000_001)
    assert too_big.status_code == 413
    missing = _post(fake_server, "retrieve_future", json={"request_id": "req-never-issued"})
    assert missing.status_code == 404 and "never issued" in missing.json()["error"]
    assert httpx.get(f"{fake_server.base_url}/api/v1/healthz").json() == {"status": "ok"}


def test_retrieve_future_answers_408_while_pending(fake_server: RunningServer, client: tinker.ServiceClient) -> None:
    trainer = client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    # seq_id 5 waits for seq_ids 1-4, which never come: it stays pending.
    pending = _post(
        fake_server,
        "optim_step",
        json={"model_id": trainer.model_id, "seq_id": 5, "adam_params": {"learning_rate": 0.1}},
    ).json()["request_id"]
    poll = _post(fake_server, "retrieve_future", json={"request_id": pending})
    assert poll.status_code == 408 and poll.json()["type"] == "try_again"


def test_rest_endpoints_list_runs_and_checkpoints(fake_server: RunningServer, client: tinker.ServiceClient) -> None:
    trainer = client.create_lora_training_client(base_model=BASE_MODEL, rank=8, user_metadata={"owner": "test"}).result()
    state = trainer.save_state("s1").result().path
    sampler_path = trainer.save_weights_for_sampler("w1").result().path
    rest = tinker.RestClient(base_url=fake_server.base_url, api_key=KEY)
    run = rest.get_training_run(trainer.model_id).result()
    assert (run.base_model, run.lora_rank, run.user_metadata) == (BASE_MODEL, 8, {"owner": "test"})
    assert run.last_checkpoint.tinker_path == state and run.last_sampler_checkpoint.tinker_path == sampler_path
    listed = rest.list_checkpoints(trainer.model_id).result().checkpoints
    assert {c.tinker_path for c in listed} == {state, sampler_path}
    assert trainer.model_id in {r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs}
    assert rest.get_weights_info_by_tinker_path(state).result().lora_rank == 8
    assert [m.model_name for m in rest.get_server_capabilities().result().supported_models] == [BASE_MODEL]
    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    assert [c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result().checkpoints] == [state]


def test_concurrent_clients_do_not_interfere(client: tinker.ServiceClient, fake_server: RunningServer) -> None:
    def train(tokens: list[int], out: dict, key: str) -> None:
        with tinker.ServiceClient(base_url=fake_server.base_url, api_key=KEY) as own:
            trainer = own.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
            losses = []
            for _ in range(4):
                fb = trainer.forward_backward([_datum(tokens)], "cross_entropy")
                trainer.optim_step(types.AdamParams(learning_rate=0.1))
                losses.append(fb.result().metrics["loss:sum"])
            out[key] = losses

    alone: dict = {}
    train([1, 2, 3, 4], alone, "a")
    train([9, 8, 7], alone, "b")
    together: dict = {}
    threads = [threading.Thread(target=train, args=(t, together, k)) for t, k in (([1, 2, 3, 4], "a"), ([9, 8, 7], "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert together == alone


def test_api_key_is_required_when_configured(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="localtinker.protocol")
    with start_server(tmp_path, engine=FakeEngine(tmp_path), api_key="tml-secret") as server:
        missing = httpx.post(f"{server.base_url}/api/v1/create_session", json={})
        assert missing.status_code == 401 and "X-API-Key header is missing" in missing.json()["error"]
        with pytest.raises(tinker.AuthenticationError, match="X-API-Key header is wrong"):
            tinker.ServiceClient(base_url=server.base_url, api_key="tml-wrong").create_lora_training_client(base_model=BASE_MODEL)
        with tinker.ServiceClient(base_url=server.base_url, api_key="tml-secret") as good:
            assert good.create_lora_training_client(base_model=BASE_MODEL, rank=2).result().get_info().lora_rank == 2
        assert httpx.get(f"{server.base_url}/api/v1/healthz").status_code == 200
    request_lines = [r.getMessage() for r in caplog.records if r.name == "localtinker.protocol"]
    assert any(line.startswith("POST /api/v1/create_session 401") for line in request_lines)
    assert not any("tml-secret" in line or "tml-wrong" in line for line in request_lines)


def test_checkpoints_and_run_records_survive_a_restart(tmp_path: Path) -> None:
    with start_server(tmp_path, engine=FakeEngine(tmp_path)) as server, tinker.ServiceClient(
        base_url=server.base_url, api_key=KEY
    ) as first:
        trainer = first.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        trainer.forward_backward([_datum([5, 6, 7])], "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=0.2)).result()
        path = trainer.save_state("kept").result().path
        expected = trainer.forward([_datum([1, 2, 3])], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    with start_server(tmp_path, engine=FakeEngine(tmp_path)) as server, tinker.ServiceClient(
        base_url=server.base_url, api_key=KEY
    ) as second:
        restored = second.create_training_client_from_state(path).result()
        got = restored.forward([_datum([1, 2, 3])], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        assert got == expected
        rest = tinker.RestClient(base_url=server.base_url, api_key=KEY)
        assert rest.get_weights_info_by_tinker_path(path).result().base_model == BASE_MODEL
