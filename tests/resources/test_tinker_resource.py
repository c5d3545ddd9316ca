"""TinkerResource: backend resolution, secrecy of the key, and a real embedded localtinker through the SDK."""

from types import SimpleNamespace

import dagster as dg
import pytest
import tinker

from resources.tinker import EMBEDDED_SERVERS, EXISTING_LOCAL_SERVER_KEY, TinkerResource
from tests.fixtures.server import TINY_MODEL

SECRET = "tml-this-is-a-secret-key"


def test_auto_is_remote_when_a_key_is_configured_and_describe_never_shows_it():
    resource = TinkerResource(api_key=SECRET)
    endpoint = resource.endpoint()
    assert (endpoint.backend, endpoint.base_url, endpoint.api_key, endpoint.embedded) == ("remote", None, SECRET, False)
    assert SECRET not in repr(resource.describe())
    assert resource.describe()["tinker_backend"] == "remote"


def test_auto_without_a_key_uses_an_existing_local_server_when_given_its_url():
    endpoint = TinkerResource(base_url="http://127.0.0.1:8123").endpoint()
    assert (endpoint.backend, endpoint.base_url, endpoint.api_key, endpoint.embedded) == (
        "local",
        "http://127.0.0.1:8123",
        EXISTING_LOCAL_SERVER_KEY,
        False,
    )


def test_remote_without_a_key_and_unknown_backends_fail_with_the_fix():
    with pytest.raises(ValueError, match="TINKER_API_KEY"):
        TinkerResource(backend="remote").endpoint()
    with pytest.raises(ValueError, match="'auto', 'local', 'remote'"):
        TinkerResource(backend="hosted").endpoint()


def test_the_key_from_envvar_stays_out_of_run_config_logs_and_metadata(monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", SECRET)

    @dg.asset
    def uses_tinker(context: dg.AssetExecutionContext, tinker_backend: TinkerResource) -> dg.MaterializeResult:
        context.log.info(f"backend: {tinker_backend.describe()}")
        assert tinker_backend.endpoint().api_key == SECRET
        return dg.MaterializeResult(metadata=tinker_backend.describe())

    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize(
        [uses_tinker], resources={"tinker_backend": TinkerResource(api_key=dg.EnvVar("TINKER_API_KEY"))}, instance=instance
    )
    assert result.success
    stored = instance.get_run_by_id(result.run_id)
    assert SECRET not in repr(stored.run_config)
    events = instance.all_logs(result.run_id)
    assert events and all(SECRET not in repr(event) for event in events)


def test_embedded_localtinker_is_started_once_per_process_and_serves_the_real_sdk(tmp_path):
    resource = TinkerResource(backend="local", storage_dir=str(tmp_path / "tinker"), local_dtype="float32")
    first = resource.endpoint()
    again = TinkerResource(backend="local", storage_dir=str(tmp_path / "tinker"), local_dtype="float32").endpoint()
    try:
        assert first.embedded and first.base_url.startswith("http://127.0.0.1:")
        assert again.base_url == first.base_url
        # what the run trained on, for its metadata and MLflow tags
        assert (first.describe()["tinker_local_device"], first.describe()["tinker_local_dtype"]) == ("cpu", "float32")
        client = resource.get_client()
        assert isinstance(client, tinker.ServiceClient)
        sampler = client.create_sampling_client(base_model="localtinker/tiny-random").result()
        params = tinker.SamplingParams(max_tokens=3, temperature=1.0, seed=7, stop=[])
        response = sampler.sample(tinker.ModelInput.from_ints([1, 2, 3]), 1, params).result()
        assert len(response.sequences[0].tokens) == 3
    finally:
        EMBEDDED_SERVERS.stop_all()


def test_a_failed_step_closes_its_tinker_session_as_errored_with_the_reason(tinker_server):
    registry = tinker_server.service.registry
    before = set(registry.sessions)
    resource = TinkerResource(backend="local", base_url=tinker_server.base_url)
    with pytest.raises(RuntimeError, match="diverged"):
        with resource.session("sft_checkpoint 1a2b3c4d") as client:
            client.create_sampling_client(base_model=TINY_MODEL)  # opens the Tinker session
            raise RuntimeError("loss diverged")
    (new,) = set(registry.sessions) - before
    assert registry.sessions[new].finished == "errored"

    with resource.session("sft_checkpoint 5e6f7a8b") as client:
        client.create_sampling_client(base_model=TINY_MODEL)  # a step that succeeds keeps its session open
    (second,) = set(registry.sessions) - before - {new}
    assert registry.sessions[second].finished is None


def test_an_embedded_engine_on_a_gpu_is_described_by_its_card(monkeypatch):
    """The device tag of a run trained on a GPU names the card and what it lacks (faked cards: the description
    reads their name and compute capability); a remote or existing server has no such tags."""
    import torch

    from resources.tinker import _engine_described

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    engine = SimpleNamespace(device=torch.device("cuda", 0), dtype="float32")
    assert _engine_described(engine) == ("cuda:0 = Tesla T4, sm75, without bf16, flash kernels", "float32")
    assert "tinker_local_device" not in TinkerResource(api_key="tml-x", backend="remote").describe()
