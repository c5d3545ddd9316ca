"""Sessions (get, list, search, trace export) and checkpoint publishing through the real SDK and CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import tinker
from tinker import types

from localtinker.server import RunningServer
from tests.fixtures.server import LOCAL_API_KEY, TINY_MODEL


def _cli(server: RunningServer, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TINKER_BASE_URL": server.base_url, "TINKER_API_KEY": LOCAL_API_KEY}
    return subprocess.run([sys.executable, "-m", "tinker.cli", *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def session(tinker_server: RunningServer) -> tuple[str, str, str]:
    """(session id, training run id, a saved state path) of a finished session that trained and sampled."""
    client = tinker.ServiceClient(
        base_url=tinker_server.base_url, api_key=LOCAL_API_KEY, user_metadata={"team": "weights"}, display_name="Nightly SFT run"
    )
    trainer = client.create_lora_training_client(base_model=TINY_MODEL, rank=2).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0] * 3}
    )
    trainer.forward_backward([datum], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result()
    state = trainer.save_state("published").result().path
    session_id = client.holder.get_session_id()
    client.close("success").result(timeout=60)
    return session_id, trainer.model_id, state


@pytest.mark.filterwarnings("ignore::tinker.lib.experimental.ExperimentalWarning")
def test_get_list_and_search_sessions(tinker_server: RunningServer, session: tuple[str, str, str]) -> None:
    session_id, run_id, _ = session
    rest = tinker.RestClient(base_url=tinker_server.base_url, api_key=LOCAL_API_KEY)
    got = rest.get_session(session_id).result()
    assert got.training_run_ids == [run_id] and len(got.sampler_ids) == 1
    assert got.user_metadata == {"team": "weights"} and got.display_name == "Nightly SFT run"
    assert session_id in rest.list_sessions(limit=100).result().sessions
    found = rest.search_sessions(types.SessionSearchRequest(display_name="sft NIGHTLY", user_metadata={"team": "weights"})).result()
    assert [s.session_id for s in found.sessions] == [session_id]
    summary = found.sessions[0]
    assert summary.status.type == "client_finished" and summary.status.reason.type == "success"
    assert summary.checkpoints_count == 1 and summary.checkpoint_storage_bytes > 0
    active = rest.search_sessions(types.SessionSearchRequest(session_id=session_id, statuses=[{"type": "active"}])).result()
    assert active.sessions == []
    with pytest.raises(tinker.NotFoundError, match="unknown session"):
        rest.get_session("no-such-session").result()


def test_session_trace_is_served_keyless(tinker_server: RunningServer, session: tuple[str, str, str]) -> None:
    session_id, run_id, _ = session
    rest = tinker.RestClient(base_url=tinker_server.base_url, api_key=LOCAL_API_KEY)
    url = rest.export_session_trace(session_id).result()
    with urllib.request.urlopen(url, timeout=10) as response:  # keyless, as the SDK documents
        trace = json.load(response)
    names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert names[:2] == ["forward_backward", "optim_step"] and "sample" in names and "save_weights" in names
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert run_id in tracks


def _is_public(server: RunningServer, run_id: str, path: str) -> bool:
    rest = tinker.RestClient(base_url=server.base_url, api_key=LOCAL_API_KEY)
    return next(c for c in rest.list_checkpoints(run_id).result().checkpoints if c.tinker_path == path).public


def test_publish_and_unpublish(tinker_server: RunningServer, session: tuple[str, str, str]) -> None:
    _, run_id, state = session
    rest = tinker.RestClient(base_url=tinker_server.base_url, api_key=LOCAL_API_KEY)
    rest.publish_checkpoint_from_tinker_path(state).result()
    assert _is_public(tinker_server, run_id, state)
    rest.publish_checkpoint_from_tinker_path(state).result()  # idempotent (hosted's 409 makes the SDK retry 5 min)
    rest.unpublish_checkpoint_from_tinker_path(state).result()
    assert not _is_public(tinker_server, run_id, state)


@pytest.mark.slow
def test_cli_session_and_publish_commands(tinker_server: RunningServer, session: tuple[str, str, str], tmp_path: Path) -> None:
    session_id, run_id, state = session
    out = tmp_path / "session.pftrace"
    run = _cli(tinker_server, "session", "export-trace", session_id, "--output", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(out.read_text())["traceEvents"]
    run = _cli(tinker_server, "checkpoint", "publish", state)
    assert run.returncode == 0 and _is_public(tinker_server, run_id, state), run.stderr[-2000:]
    run = _cli(tinker_server, "checkpoint", "unpublish", state)
    assert run.returncode == 0 and not _is_public(tinker_server, run_id, state), run.stderr[-2000:]
