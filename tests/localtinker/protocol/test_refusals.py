"""Every request the server refuses (unknown route 404, 405, 400) frees its seq_id at once.

A refused training-client request never runs, so without that the client's next request would wait the
whole gap timeout for the missing seq_id. Driven by the real SDK; the odd routes are reached by pointing one
SDK call at them, as a newer SDK calling an endpoint this server lacks would.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import tinker
from tinker import types
from tinker._base_client import make_request_options
from tinker._compat import model_dump
from tinker.resources.weights import AsyncWeightsResource
from tinker.types.shared.untyped_api_future import UntypedAPIFuture

from localtinker.protocol.app import ProtocolConfig
from localtinker.server import RunningServer, start_server

from .fake_engine import BASE_MODEL, FakeEngine

KEY = "tml-local"
NEXT_REQUEST_WITHIN_S = 5.0  # far under the gap timeout below


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    storage = tmp_path_factory.mktemp("refusal-storage")
    config = ProtocolConfig(long_poll_s=0.3, gap_timeout_s=60.0)
    with start_server(storage, engine=FakeEngine(storage), config=config) as running:
        yield running


@pytest.fixture
def trainer(server: RunningServer) -> Iterator[tinker.TrainingClient]:
    service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    yield service.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    service.close("success").result(timeout=30)


def _next_op_is_prompt(trainer: tinker.TrainingClient) -> None:
    started = time.monotonic()
    trainer.optim_step(types.AdamParams(learning_rate=0.01)).result(timeout=NEXT_REQUEST_WITHIN_S)
    assert time.monotonic() - started < NEXT_REQUEST_WITHIN_S


def _send_save_external_to(monkeypatch: pytest.MonkeyPatch, method: str, route: str, changes: dict[str, object]) -> None:
    """Points the SDK's save_weights_external at another route: a newer SDK calling what this server lacks."""

    async def send(self: AsyncWeightsResource, *, request: object, max_retries: object = None) -> UntypedAPIFuture:
        body = {**model_dump(request, exclude_unset=False, exclude_none=True, mode="json"), **changes}
        send_request = getattr(self, f"_{method.lower()}")
        options = make_request_options()
        options["max_retries"] = 0
        return await send_request(f"/api/v1/{route}", body=body, options=options, cast_to=UntypedAPIFuture)

    monkeypatch.setattr(AsyncWeightsResource, "save_external", send)


@pytest.mark.parametrize(
    ("method", "path", "changes", "status", "message"),
    [
        ("POST", "no_such_training_op", {}, 404, "no_such_training_op: localtinker has no such endpoint"),
        ("PUT", "save_weights", {}, 405, "does not take PUT; it takes POST"),
        ("POST", "save_weights", {"path": ""}, 400, "checkpoint name '' must be non-empty"),
        ("POST", "optim_step", {"adam_params": {"learning_rate": -1}}, 400, "AdamParams"),
    ],
)
def test_a_refused_request_does_not_hold_up_the_next(
    monkeypatch: pytest.MonkeyPatch,
    trainer: tinker.TrainingClient,
    method: str,
    path: str,
    changes: dict[str, object],
    status: int,
    message: str,
) -> None:
    _send_save_external_to(monkeypatch, method, path, changes)
    with pytest.raises(tinker.APIStatusError, match=message) as refused:
        trainer.save_weights_external("elsewhere").result(timeout=10)
    assert refused.value.status_code == status
    _next_op_is_prompt(trainer)


def test_a_call_refused_through_the_sdk_does_not_hold_up_the_next(trainer: tinker.TrainingClient) -> None:
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds=60"):
        trainer.save_state("short-lived", ttl_seconds=60).result(timeout=10)
    _next_op_is_prompt(trainer)
    with pytest.raises(tinker.BadRequestError, match="AdamParams.learning_rate"):
        trainer.optim_step(types.AdamParams(learning_rate=-0.5)).result(timeout=10)
    _next_op_is_prompt(trainer)
