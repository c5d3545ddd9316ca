"""A finished or silent session's training and sampling clients are released (a long-running server does not
keep every past script's adapter and optimizer state); its checkpoints stay, and requests naming its clients get
a 410 that says why and how to go on. Only the newest finished sessions keep their request traces."""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tinker
from tinker import types

from localtinker.protocol.core import ProtocolConfig
from localtinker.server import RunningServer, start_server
from tests.fixtures.network import free_port
from tests.fixtures.server import LOCAL_API_KEY, TINY_MODEL, serve_subprocess

DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0] * 3}
)


def _post(server: RunningServer, endpoint: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{server.base_url}/api/v1/{endpoint}", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "X-API-Key": LOCAL_API_KEY},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not released in time"
        time.sleep(0.05)


def _trained_client(server: RunningServer) -> tuple[tinker.ServiceClient, tinker.TrainingClient, str, str]:
    """(client, trainer, its sampler's id, a saved state path) after one step and one sample."""
    client = tinker.ServiceClient(base_url=server.base_url, api_key=LOCAL_API_KEY)
    trainer = client.create_lora_training_client(base_model=TINY_MODEL, rank=2, seed=1).result()
    trainer.forward_backward([DATUM], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result()
    state = trainer.save_state("kept").result().path
    session_id = client.holder.get_session_id()
    sampler_ids = server.service.registry.session_samplers(session_id)
    assert len(sampler_ids) == 1
    return client, trainer, sampler_ids[0], state


def test_a_finished_sessions_clients_are_released_and_its_checkpoints_stay(tinker_server: RunningServer) -> None:
    engine = tinker_server.engine
    client, trainer, sampler_id, state = _trained_client(tinker_server)
    model_id = trainer.model_id
    assert model_id in engine._models and sampler_id in engine._samplers
    key = engine._samplers[sampler_id].weights_key
    assert key in engine._hosts[TINY_MODEL].resident  # the snapshot it sampled is a resident adapter
    assert engine.snapshots.find(model_id, engine._models[model_id].version) is not None
    client.close("success").result(timeout=60)

    resident = engine._hosts[TINY_MODEL].resident
    _wait_for(lambda: model_id not in engine._models and sampler_id not in engine._samplers  # the worker releases
              and key not in resident)  # the adapter the sampler used left memory with it
    assert all(snapshot.model_id != model_id for snapshot in engine.snapshots._snapshots.values())
    status, body = _post(tinker_server, "optim_step", {"model_id": model_id, "seq_id": 99, "adam_params": {}})
    assert status == 410
    assert "has finished (success); its training and sampling clients were released" in body["error"]
    assert "create_training_client_from_state" in body["error"]
    status, body = _post(tinker_server, "asample", {"sampling_session_id": sampler_id, "num_samples": 1,
                                                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                                                    "sampling_params": {"max_tokens": 2}})
    assert status == 410 and "has finished (success)" in body["error"]
    status, body = _post(tinker_server, "create_sampling_session", {
        "session_id": model_id.split(":train:")[0], "sampling_session_seq_id": 7, "base_model": TINY_MODEL})
    assert status == 410 and "has finished (success)" in body["error"]

    with tinker.ServiceClient(base_url=tinker_server.base_url, api_key=LOCAL_API_KEY) as fresh:
        resumed = fresh.create_training_client_from_state_with_optimizer(state).result()
        resumed.forward_backward([DATUM], "cross_entropy").result()  # the checkpoint outlived its session


def test_a_silent_session_expires_and_a_live_one_does_not(tmp_path: Path) -> None:
    """The SDK heartbeats every 10 s; with a 1 s timeout a session is silent after its first second. The next
    session's creation sweeps: the silent one is released, the new one is not."""
    config = ProtocolConfig(api_key=LOCAL_API_KEY, session_timeout_s=1.0)
    with start_server(tmp_path, dtype="float32", config=config) as server:
        client, trainer, sampler_id, _ = _trained_client(server)
        model_id = trainer.model_id
        time.sleep(1.5)
        with tinker.ServiceClient(base_url=server.base_url, api_key=LOCAL_API_KEY) as other:
            other_trainer = other.create_lora_training_client(base_model=TINY_MODEL, rank=2).result()
            _wait_for(lambda: model_id not in server.engine._models and sampler_id not in server.engine._samplers)
            status, body = _post(server, "optim_step", {"model_id": model_id, "seq_id": 99, "adam_params": {}})
            assert status == 410 and "expired (no heartbeat for 1 s)" in body["error"]
            # from here on, a slow machine must not expire the live session too (its first heartbeat is 10 s off)
            server.service.config = dataclasses.replace(config, session_timeout_s=0)
            other_trainer.forward_backward([DATUM], "cross_entropy").result()  # the live session still trains
            assert other_trainer.model_id in server.engine._models
        client.close("success").result(timeout=60)  # a goodbye after expiry changes nothing


def test_without_a_timeout_silent_sessions_keep_their_clients(tmp_path: Path) -> None:
    config = ProtocolConfig(api_key=LOCAL_API_KEY, session_timeout_s=0)
    with start_server(tmp_path, dtype="float32", config=config) as server:
        with tinker.ServiceClient(base_url=server.base_url, api_key=LOCAL_API_KEY) as client:
            trainer = client.create_lora_training_client(base_model=TINY_MODEL, rank=2).result()
            server.service.registry.session(client.holder.get_session_id()).last_seen -= 3600
            with tinker.ServiceClient(base_url=server.base_url, api_key=LOCAL_API_KEY) as other:
                other.create_lora_training_client(base_model=TINY_MODEL, rank=2).result()
            trainer.forward_backward([DATUM], "cross_entropy").result()
            assert trainer.model_id in server.engine._models


@pytest.mark.parametrize("reason", ["errored", "interrupted"])
def test_any_finish_reason_releases(tinker_server: RunningServer, reason: str) -> None:
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=LOCAL_API_KEY)
    trainer = client.create_lora_training_client(base_model=TINY_MODEL, rank=2).result()
    client.close(reason, "a test").result(timeout=60)
    _wait_for(lambda: trainer.model_id not in tinker_server.engine._models)
    status, body = _post(tinker_server, "get_info", {"model_id": trainer.model_id})
    assert status == 410 and f"has finished ({reason})" in body["error"]


def test_only_the_newest_finished_sessions_keep_their_traces(tmp_path: Path) -> None:
    """Each session's trace holds up to 20,000 requests; a long-running server keeps the traces of the newest
    ``finished_traces_kept`` finished sessions and says so for older ones."""
    config = ProtocolConfig(api_key=LOCAL_API_KEY, finished_traces_kept=1)
    with start_server(tmp_path, dtype="float32", config=config) as server:
        sessions = []
        for _ in range(2):
            client = tinker.ServiceClient(base_url=server.base_url, api_key=LOCAL_API_KEY)
            trainer = client.create_lora_training_client(base_model=TINY_MODEL, rank=2).result()
            trainer.forward_backward([DATUM], "cross_entropy").result()
            sessions.append(client.holder.get_session_id())
            client.close("success").result(timeout=60)
        rest = tinker.RestClient(base_url=server.base_url, api_key=LOCAL_API_KEY)
        with urllib.request.urlopen(rest.export_session_trace(sessions[1]).result(), timeout=10) as response:
            assert any(e.get("name") == "forward_backward" for e in json.load(response)["traceEvents"])
        with pytest.raises(tinker.APIStatusError, match="was dropped: localtinker keeps the traces of the 1 most "
                                                        "recently finished sessions"):
            rest.export_session_trace(sessions[0]).result()
        assert rest.get_session(sessions[0]).result().training_run_ids  # the session itself is still listed


def test_the_serve_command_takes_the_session_timeout(tmp_path: Path) -> None:
    """``python -m localtinker serve --session-timeout 1``: a session silent for over a second is released when
    another one starts."""
    with serve_subprocess(tmp_path, free_port(), "--session-timeout", "1") as base_url:
        with tinker.ServiceClient(base_url=base_url, api_key=LOCAL_API_KEY) as client:
            trainer = client.create_lora_training_client(base_model=TINY_MODEL, rank=2).result()
            time.sleep(1.5)
            with tinker.ServiceClient(base_url=base_url, api_key=LOCAL_API_KEY) as other:
                other.create_lora_training_client(base_model=TINY_MODEL, rank=2).result()
            request = urllib.request.Request(
                f"{base_url}/api/v1/get_info", data=json.dumps({"model_id": trainer.model_id}).encode(),
                method="POST", headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as failed:
                urllib.request.urlopen(request, timeout=30)
            assert failed.value.code == 410
            assert "expired (no heartbeat for 1 s)" in json.loads(failed.value.read())["error"]
