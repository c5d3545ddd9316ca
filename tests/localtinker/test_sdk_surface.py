"""The SDK surface table (localtinker/sdk_surface.py) covers every public SDK method and CLI command, and
the calls it credits to this file work against ``python -m localtinker serve``."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
import tinker
from tinker import types
from tinker.lib.api_future_impl import QueueState
from tinker.lib.public_interfaces.admin_client import AdminClient

from localtinker.sdk_surface import CLI_COMMANDS, HOSTED, SDK_METHODS, WORKS, document
from tests.fixtures.network import free_port
from tests.fixtures.server import LOCAL_API_KEY, TINY_MODEL, serve_subprocess

REPO = Path(__file__).resolve().parents[2]
CLIENTS = (tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.RestClient, AdminClient)


def public_sdk_methods() -> set[str]:
    """Public callables of the SDK's clients; the ``*_async`` twins are deprecated aliases of the same calls."""
    return {
        f"{cls.__name__}.{name}"
        for cls in CLIENTS
        for name, value in inspect.getmembers(cls)
        if not name.startswith("_") and callable(value) and not name.endswith("_async")
    }


def cli_commands() -> set[str]:
    import tinker.cli.__main__ as cli_main

    group = next(v for v in vars(cli_main).values() if isinstance(v, click.Group))
    context = click.Context(group)
    commands = set()
    for name in group.list_commands(context):
        command = group.get_command(context, name)
        if isinstance(command, click.Group):
            commands |= {f"{name} {sub}" for sub in command.list_commands(context)}
        else:
            commands.add(name)
    return commands


def test_every_sdk_method_and_cli_command_is_in_the_table() -> None:
    methods, commands = public_sdk_methods(), cli_commands()
    assert not methods - set(SDK_METHODS), f"add these SDK methods to localtinker/sdk_surface.py: {sorted(methods - set(SDK_METHODS))}"
    assert not set(SDK_METHODS) - methods, f"no longer in the SDK: {sorted(set(SDK_METHODS) - methods)}"
    assert commands == set(CLI_COMMANDS), f"CLI commands differ: {sorted(commands ^ set(CLI_COMMANDS))}"
    assert {status for status, _ in [*SDK_METHODS.values(), *CLI_COMMANDS.values()]} <= {WORKS, HOSTED}


def test_the_docs_table_is_the_module() -> None:
    written = (REPO / "docs" / "sdk_surface.md").read_text()
    assert written == document(), "regenerate: python -m localtinker.sdk_surface > docs/sdk_surface.md"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve_subprocess(tmp_path_factory.mktemp("surface-storage"), free_port(), "--api-key", LOCAL_API_KEY) as base_url:
        yield base_url


def _cli(base_url: str, *args: str) -> str:
    env = {**os.environ, "TINKER_BASE_URL": base_url, "TINKER_API_KEY": LOCAL_API_KEY}
    run = subprocess.run([sys.executable, "-m", "tinker.cli", *args], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"tinker {' '.join(args)}: {run.stderr[-2000:]}"
    return run.stdout


@pytest.mark.slow
def test_the_calls_credited_here_work_against_the_cli_server(served: str) -> None:
    service = tinker.ServiceClient(base_url=served, api_key=LOCAL_API_KEY)
    assert service.get_telemetry() is None  # TINKER_TELEMETRY=0
    assert TINY_MODEL in [m.model_name for m in service.get_server_capabilities().supported_models]
    rest = service.create_rest_client()
    assert rest.get_telemetry() is None
    trainer = service.create_lora_training_client(base_model=TINY_MODEL, rank=2).result()
    assert trainer.get_telemetry() is None
    state = trainer.save_state("surface").result().path
    sampler_path = trainer.save_weights_for_sampler("surface").result().path
    sampler = trainer.create_sampling_client(sampler_path).result()
    assert sampler.get_telemetry() is None
    sampler.on_queue_state_change(QueueState.ACTIVE, None)
    copy = tinker.SamplingClient.from_sampler_handle(sampler.get_sampler_handle(), api_key=LOCAL_API_KEY)
    prompt = types.ModelInput.from_ints([1, 2, 3])
    assert copy.compute_logprobs(prompt).result() == sampler.compute_logprobs(prompt).result()
    created = tinker.SamplingClient.create(service.holder, model_path=sampler_path).result()
    assert created.get_base_model() == TINY_MODEL
    sampler_id = sampler._sampling_session_id  # what RestClient.get_sampler takes; the SDK keeps it private
    assert rest.get_sampler(sampler_id).result().base_model == TINY_MODEL
    assert rest.get_training_run_by_tinker_path(state).result().training_run_id == trainer.model_id
    rest.delete_checkpoint(trainer.model_id, "sampler_weights/surface").result()

    for args in (["version"], ["model", "list"], ["run", "list"], ["run", "info", trainer.model_id],
                 ["checkpoint", "list", "--run-id", trainer.model_id], ["checkpoint", "info", state],
                 ["checkpoint", "set-ttl", state, "--ttl", "7200"]):
        _cli(served, *args)
    listed = json.loads(_cli(served, "--format", "json", "checkpoint", "list", "--run-id", trainer.model_id))
    assert [c["tinker_path"] for c in listed["checkpoints"]] == [state] and listed["checkpoints"][0]["expires_at"]
    _cli(served, "checkpoint", "delete", state, "--yes")
    assert rest.list_checkpoints(trainer.model_id).result().checkpoints == []
    service.close("success").result(timeout=60)
