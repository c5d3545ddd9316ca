"""Weights out through the real SDK and the real ``tinker`` CLI: save_weights_external, signed URLs fetched
with no API key, ``tinker checkpoint download`` of training and external paths, and a download that plain
peft loads and scores exactly as the server does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from localtinker.engine.models import tiny_random_dir
from localtinker.server import RunningServer, start_server
from tests.fixtures.server import TINY_MODEL

KEY = "tml-weights-test"
TOKENS = [1, 33, 4096, 17, 900, 2, 77, 31000]
ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server that demands an API key, so the keyless download GETs are really keyless."""
    with start_server(tmp_path_factory.mktemp("weights-storage"), dtype="float32", api_key=KEY) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[tinker.ServiceClient]:
    service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    yield service
    service.close("success").result(timeout=60)


@pytest.fixture(scope="module")
def trained(client: tinker.ServiceClient) -> tinker.TrainingClient:
    trainer = client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=3).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )
    for _ in range(3):
        trainer.forward_backward([datum], "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=0.05)).result()
    return trainer


def _cli(server: RunningServer, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TINKER_BASE_URL": server.base_url, "TINKER_API_KEY": KEY}
    return subprocess.run(
        [sys.executable, "-m", "tinker.cli", *args], env=env, capture_output=True, text=True, timeout=180
    )


def _peft_logprobs(adapter_dir: Path, tokens: list[int]) -> np.ndarray:
    """What a user gets from the download with transformers + peft alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_random_dir(), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()


def test_external_weights_urls_are_signed_keyless_and_listed(
    server: RunningServer, client: tinker.ServiceClient, trained: tinker.TrainingClient
) -> None:
    path = trained.save_weights_external("export", ttl_seconds=7200).result().path
    assert path == f"tinker://{trained.model_id}/external_weights/export"
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY)
    signed = rest.get_external_weights_urls(path).result()
    assert set(signed.urls) == ADAPTER_FILES
    config = httpx.get(signed.urls["adapter_config.json"], timeout=10)  # no API key, as the CLI fetches
    assert config.status_code == 200
    assert json.loads(config.content)["r"] == 4 and json.loads(config.content)["base_model_name_or_path"] == TINY_MODEL
    forged = signed.urls["adapter_config.json"].replace("/downloads/", "/downloads/x")
    assert httpx.get(forged, timeout=10).status_code == 403
    listed = {c.tinker_path: c for c in rest.list_checkpoints(trained.model_id).result().checkpoints}
    assert listed[path].checkpoint_type == "external" and listed[path].expires_at is not None
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert path not in {c.tinker_path for c in rest.list_checkpoints(trained.model_id).result().checkpoints}
    gone = httpx.get(signed.urls["adapter_model.safetensors"], timeout=10)
    assert gone.status_code == 404 and "deleted" in gone.json()["error"]


def test_external_weights_cannot_be_sampled_or_loaded_back(
    client: tinker.ServiceClient, trained: tinker.TrainingClient
) -> None:
    path = trained.save_weights_external("not-loadable").result().path
    with pytest.raises(tinker.BadRequestError, match="exported for download"):
        client.create_sampling_client(model_path=path).result()
    with pytest.raises(Exception, match="exported for download"):
        client.create_training_client_from_state(path).result()


@pytest.mark.slow
def test_cli_download_loads_in_plain_peft_and_matches_the_server(
    server: RunningServer, client: tinker.ServiceClient, trained: tinker.TrainingClient, tmp_path: Path
) -> None:
    state = trained.save_state("for-download").result().path
    external = trained.save_weights_external("for-download").result().path
    server_logprobs = np.array(
        client.create_sampling_client(model_path=state).result().compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()[1:]
    )
    for path in (state, external):
        run = _cli(server, "checkpoint", "download", path, "--output", str(tmp_path))
        assert run.returncode == 0, run.stderr[-3000:]
        directory = tmp_path / path.removeprefix("tinker://").replace("/", "_")
        assert {f.name for f in directory.iterdir()} == ADAPTER_FILES
        downloaded = _peft_logprobs(directory, TOKENS)
        assert np.max(np.abs(downloaded - server_logprobs)) <= 1e-4
    base = client.create_sampling_client(base_model=TINY_MODEL).result().compute_logprobs(types.ModelInput.from_ints(TOKENS))
    assert np.max(np.abs(np.array(base.result()[1:]) - server_logprobs)) > 1e-3  # the adapter really changed them
    # The download of a training checkpoint went through a temporary export, which the CLI deleted again.
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY)
    assert [c.checkpoint_id for c in rest.list_user_checkpoints().result().checkpoints if "download" == c.checkpoint_id.split("/")[-1]] == []
