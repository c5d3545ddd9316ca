"""``python -m localtinker serve`` as users run it, an unmodified SDK script against it, and restarts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from localtinker.server import start_server
from tests.fixtures.network import free_port
from tests.fixtures.server import LOCAL_API_KEY, TINY_MODEL, serve_subprocess

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cli_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    storage = tmp_path / "storage"
    with serve_subprocess(storage, free_port()) as base_url:
        yield base_url, storage


def test_unmodified_sdk_script_runs_against_the_cli_server(cli_server: tuple[str, Path]) -> None:
    base_url, storage = cli_server
    env = {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"], "TINKER_BASE_URL": base_url, "TINKER_API_KEY": LOCAL_API_KEY}
    if "LOCALTINKER_HOME" in os.environ:  # where this machine caches the tiny model's tokenizer
        env["LOCALTINKER_HOME"] = os.environ["LOCALTINKER_HOME"]
    run = subprocess.run(
        [sys.executable, str(REPO / "examples" / "tinker_sdk_script.py"), "--base-model", TINY_MODEL, "--steps", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss/token ([0-9.]+)", run.stdout)]
    assert len(losses) == 3 and losses[2] < losses[0]
    assert run.stdout.count("sample ") == 2
    state_path = re.search(r"saved state (tinker://\S+)", run.stdout).group(1)
    assert state_path.endswith("/weights/example-final")


def test_checkpoints_load_identically_after_an_in_process_restart(tmp_path: Path) -> None:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([4, 40, 400, 4000]),
        loss_fn_inputs={"target_tokens": [40, 400, 4000, 4], "weights": [1.0] * 4},
    )
    with start_server(tmp_path) as server, tinker.ServiceClient(base_url=server.base_url, api_key=LOCAL_API_KEY) as client:
        trainer = client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=9).result()
        run_id = trainer.model_id
        trainer.forward_backward([datum], "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        state = trainer.save_state("before-restart").result().path
        sampler_path = trainer.save_weights_for_sampler("before-restart").result().path
        expected = trainer.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    with start_server(tmp_path) as server, tinker.ServiceClient(base_url=server.base_url, api_key=LOCAL_API_KEY) as client:
        restored = client.create_training_client_from_state(state).result()
        got = restored.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(got, expected, atol=1e-6)
        sampler = client.create_sampling_client(model_path=sampler_path).result()
        scored = sampler.compute_logprobs(types.ModelInput.from_ints([4, 40, 400, 4000, 4])).result()
        np.testing.assert_allclose(scored[1:], expected, atol=1e-4)
        rest = tinker.RestClient(base_url=server.base_url, api_key=LOCAL_API_KEY)
        assert {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints} == {state, sampler_path}
        assert rest.get_weights_info_by_tinker_path(state).result().lora_rank == 4
