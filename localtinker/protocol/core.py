"""What every route family shares: the futures store, the registry, the engine worker and the helpers that
read bodies, queue model ops in ``seq_id`` order and turn failures into the SDK's error shapes.

Route families (``localtinker.protocol.routes``) hold a ``ServiceCore`` and only decode, validate, queue and
encode; the app (``app.py``) composes them.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localtinker.engine.api import (
    Engine,
    EngineUserError,
    SampleExtras,
    SampleExtrasSpec,
    SampleResult,
    SampleSpec,
    UnknownModelError,
)

from . import json_codec as jc
from .downloads import SignedDownloads
from .errors import OversizedBody, ProtocolError, bad_request, not_found
from .futures import FutureStore, Payload
from .registry import Registry, SessionRecord, TraceEvent
from .worker import EngineWorker, Job, SampleJob, SequenceError

logger = logging.getLogger("localtinker.protocol")

PROTOBUF = "application/x-protobuf"
API = "/api/v1"


@dataclass(frozen=True)
class ProtocolConfig:
    api_key: str | None = None
    max_request_bytes: int = 64 * 1024 * 1024
    long_poll_s: float = 35.0  # < the SDK's 45 s client timeout per retrieve_future poll
    result_retention_s: float = 900.0
    gap_timeout_s: float = 60.0
    # An idle sample stream starts once no request has arrived for sample_burst_gap_s, at most
    # sample_linger_max_s after the first, so that a burst prefills together; a lone request waits only
    # sample_linger_s while the stream has not seen bursts (worker.py).
    sample_linger_s: float = 0.005
    sample_burst_gap_s: float = 0.03
    sample_linger_max_s: float = 0.2
    # How long a signed download URL of external weights stays valid (never beyond the checkpoint's own TTL).
    download_url_ttl_s: float = 3600.0
    # Extra ClientConfigResponse flags sent to SDKs (e.g. a small fwdbwd_max_chunk_len in tests).
    client_config: dict[str, Any] = field(default_factory=dict)
    # A session not heard from for this long (the SDK heartbeats every 10 s while its process lives) is expired
    # and its training and sampling clients released, as a finished one's are; 0 = never.
    session_timeout_s: float = 1800.0
    # Finished sessions whose request traces are kept for export (up to 20,000 events, ~3 MB, each); older ones'
    # are dropped, so a long-running server does not hold every past session's trace.
    finished_traces_kept: int = 64


def error_response(status: int, message: str, category: str = "user") -> JSONResponse:
    return JSONResponse({"error": message, "category": category}, status_code=status)


def engine_error_response(e: BaseException) -> JSONResponse:
    if isinstance(e, UnknownModelError):
        return error_response(404, str(e))
    if isinstance(e, EngineUserError):
        return error_response(400, str(e))
    logger.exception("request failed inside the engine", exc_info=e)
    response = error_response(500, f"internal error: {type(e).__name__}: {e}", "server")
    response.headers["x-should-retry"] = "false"  # the same request would fail the same way
    return response


def iso(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp, tz=dt.timezone.utc).isoformat()


def session_of(model_id: str) -> str:
    return model_id.rsplit(":train:", 1)[0]


def session_of_sampler(sampler_id: str) -> str:
    return sampler_id.rsplit(":sample:", 1)[0]


Handler = Callable[[Request], Awaitable[Response]]


# The SDK retries these statuses with the same seq_id, so a request answered with one still holds its slot.
RETRIED_STATUSES = frozenset({408, 409, 429})


def is_refusal(status: int) -> bool:
    """A 4xx the SDK does not retry: the request will never come back, so its seq_id must be released."""
    return 400 <= status < 500 and status not in RETRIED_STATUSES


def refused_model_seq(body: bytes) -> tuple[str, int] | None:
    """``(model_id, seq_id)`` named by a JSON request body, if it names both (a training client's op)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    model_id, seq_id = parsed.get("model_id"), parsed.get("seq_id")
    if not isinstance(model_id, str) or not isinstance(seq_id, int) or isinstance(seq_id, bool):
        return None
    return model_id, seq_id


def page(request: Request, default_limit: int) -> tuple[int, int]:
    try:
        limit = int(request.query_params.get("limit", default_limit))
        offset = int(request.query_params.get("offset", 0))
    except ValueError as e:
        raise bad_request(f"limit and offset must be integers: {e}") from e
    if limit < 0 or offset < 0:
        raise bad_request("limit and offset must be >= 0")
    return limit, offset


class ServiceCore:
    """Owns the futures store, the registry and the engine worker, and the helpers route families share."""

    def __init__(self, engine: Engine, storage_dir: Path | None, config: ProtocolConfig = ProtocolConfig()) -> None:
        self.config = config
        self.engine = engine
        self.storage_dir = storage_dir
        self.futures = FutureStore(config.result_retention_s)
        self.registry = Registry(storage_dir)
        self.downloads = SignedDownloads()
        self.worker = EngineWorker(
            engine,
            gap_timeout_s=config.gap_timeout_s,
            sample_linger_s=config.sample_linger_s,
            sample_burst_gap_s=config.sample_burst_gap_s,
            sample_linger_max_s=config.sample_linger_max_s,
        )
        self.worker.start()
        self._finished: deque[SessionRecord] = deque()  # finished sessions whose traces are kept, oldest first

    def close(self) -> None:
        self.worker.stop()

    # ---- sessions: finishing, expiring, releasing ---------------------------------------------------------

    def finish_session(self, session: SessionRecord, reason: str) -> None:
        """Marks ``session`` finished (first reason wins) and releases its training and sampling clients: the
        engine frees their adapters, optimizer state and snapshots; checkpoints stay."""
        if session.finished is not None:
            return
        session.finished = reason
        self._finished.append(session)
        while len(self._finished) > self.config.finished_traces_kept:
            dropped = self._finished.popleft()
            dropped.events.clear()
            dropped.trace_dropped = True
        models, samplers = self.registry.session_models(session.session_id), self.registry.session_samplers(session.session_id)
        gone = self.session_gone(session.session_id)
        for model_id in models:
            self.registry.drop_model(model_id)
            self.worker.forget_model(model_id, str(gone))
        if models or samplers:
            logger.info("session %s %s: releasing %d training and %d sampling clients", session.session_id,
                        self._finish_phrase(reason), len(models), len(samplers))
            self.worker.submit_control(Job(f"release session {session.session_id}",
                                           lambda engine: engine.release(models, samplers), _ignore, _log_release_error))

    def expire_silent_sessions(self) -> None:
        """Finishes, as ``expired``, the sessions silent for longer than ``session_timeout_s`` (a client whose
        process died never says goodbye): without it a long-running server keeps their state forever."""
        if self.config.session_timeout_s <= 0:
            return
        for session in self.registry.silent_sessions(self.config.session_timeout_s):
            self.finish_session(session, "expired")

    def session_gone(self, session_id: str) -> ProtocolError | None:
        """A 410 naming why, when ``session_id`` has finished; None while it is open (or unknown)."""
        session = self.registry.session(session_id)
        if session is None or session.finished is None:
            return None
        return ProtocolError(
            410,
            f"session {session_id} {self._finish_phrase(session.finished)}; its training and sampling clients were "
            "released (checkpoints stay). Start a new ServiceClient; continue training from a checkpoint with "
            "create_training_client_from_state(<tinker:// path>).",
        )

    def check_session_open(self, session_id: str) -> None:
        gone = self.session_gone(session_id)
        if gone is not None:
            raise gone

    def _finish_phrase(self, reason: str) -> str:
        if reason == "expired":
            return f"expired (no heartbeat for {self.config.session_timeout_s:g} s)"
        return f"has finished ({reason})"

    # ---- routes and refusals ----------------------------------------------------------------------------

    def route(self, path: str, handler: Handler, method: str) -> Route:
        """A route under ``/api/v1`` whose errors take the SDK's shape and whose refusals free their seq_id."""
        return Route(f"{API}/{path}", self.endpoint(handler), methods=[method])

    def endpoint(self, handler: Handler) -> Handler:
        """``handler`` answering errors in the SDK's shape and freeing the seq_id of a refused request."""

        async def endpoint(request: Request) -> Response:
            try:
                response = await handler(request)
            except ProtocolError as e:
                response = error_response(e.status, e.message)
            except Exception as e:  # noqa: BLE001 - a bad request must never take the server down
                response = engine_error_response(e)
            if is_refusal(response.status_code):
                await self.release_refused(request)
            return response

        return endpoint

    async def release_refused(self, request: Request) -> None:
        """Frees the seq_id of a refused training-client request, so the client's next request runs at once.

        Without it the next request waits ``gap_timeout_s`` for a seq_id that will never arrive. Only JSON
        bodies are read here; forward_backward's protobuf body frees its own (routes/training.py).
        """
        body = getattr(request.state, "raw_body", None)
        if body is None:
            try:
                body = await self.body(request)
            except OversizedBody as e:
                body = e.head
            except Exception:  # noqa: BLE001 - a body that cannot be read names no seq_id
                return
        named = refused_model_seq(body)
        if named is not None:
            self.worker.skip_model_seq(*named)

    async def unrouted(self, request: Request, exc: Exception) -> Response:
        """Unknown path (404) or wrong method (405): the SDK's error shape, and the seq_id freed."""
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        where = f"{request.method} {request.url.path}"
        if status == 405:
            allowed = exc.headers.get("Allow", "") if isinstance(exc, HTTPException) and exc.headers else ""
            message = f"{where}: this endpoint does not take {request.method}; it takes {allowed}"
        else:
            message = (
                f"{where}: localtinker has no such endpoint; this call of the tinker SDK is not supported "
                "locally (README lists every SDK method and CLI command and whether it works locally)"
            )
        await self.release_refused(request)
        return error_response(status, message)

    # ---- bodies ------------------------------------------------------------------------------------

    async def body(self, request: Request) -> bytes:
        """The whole body; stops reading at the size limit and raises a 413 that keeps what was read."""
        limit = self.config.max_request_bytes
        chunks, size = [], 0
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise OversizedBody(limit, b"".join(chunks))
        body = b"".join(chunks)
        request.state.raw_body = body  # what a refusal reads to free the request's seq_id
        return body

    async def json(self, request: Request, endpoint: str) -> dict[str, Any]:
        return jc.parse_json_object(await self.body(request), endpoint)

    async def on_worker(self, describe: str, run: Callable[[Engine], Any]) -> Any:
        return await asyncio.wrap_future(self.worker.call(describe, run))

    # ---- futures plumbing ----------------------------------------------------------------------------

    def fail_future(self, request_id: str) -> Callable[[BaseException], None]:
        def on_error(e: BaseException) -> None:
            if isinstance(e, EngineUserError):
                self.futures.fail(request_id, str(e), "user")
            else:
                self.futures.fail(request_id, f"internal error: {type(e).__name__}: {e}", "server")

        return on_error

    def complete_future(self, request_id: str, encode: Callable[[Any], Payload]) -> Callable[[Any], None]:
        def on_done(result: Any) -> None:
            try:
                payload = encode(result)
            except EngineUserError as e:
                self.futures.fail(request_id, str(e), "user")
                return
            except Exception as e:  # noqa: BLE001
                logger.exception("could not encode the result of %s", request_id)
                self.futures.fail(request_id, f"internal error encoding the result: {e}", "server")
                return
            self.futures.complete(request_id, payload)

        return on_done

    # ---- sampling ------------------------------------------------------------------------------------------

    def submit_sample(
        self,
        sampler_id: str,
        spec: SampleSpec,
        extras: SampleExtrasSpec,
        on_done: Callable[[SampleResult, SampleExtras | None], None],
        on_error: Callable[[BaseException], None],
        on_progress: Callable[[list[list[int]]], None] | None = None,
    ) -> None:
        """Queues a sample into the engine's batched stream; top-k / target / alternative-token figures, when
        asked, follow as one worker job on the finished result. ``on_progress`` (streaming) gets every
        sample's tokens so far after each decode step that ran it."""
        on_done, on_error = self._traced(session_of_sampler(sampler_id), "sample", sampler_id, on_done, on_error)
        if not extras.wanted:
            self.worker.submit_sample(SampleJob(sampler_id, spec, lambda result: on_done(result, None), on_error, on_progress=on_progress))
            return

        def sampled(result: SampleResult) -> None:
            self.worker.submit_control(
                Job(
                    f"sample extras {sampler_id}",
                    lambda e: e.sample_extras(sampler_id, spec, extras, result),
                    lambda found: on_done(result, found),
                    on_error,
                )
            )

        self.worker.submit_sample(SampleJob(sampler_id, spec, sampled, on_error, on_progress=on_progress))

    def _traced(
        self, session_id: str, name: str, track: str, on_done: Callable[..., None], on_error: Callable[[BaseException], None]
    ) -> tuple[Callable[..., None], Callable[[BaseException], None]]:
        """Callbacks that also record the request in its session's trace (RestClient.export_session_trace)."""
        started = time.time()

        def done(*result: Any) -> None:
            self.registry.record_event(session_id, TraceEvent(name, track, started, time.time(), True))
            on_done(*result)

        def failed(error: BaseException) -> None:
            self.registry.record_event(session_id, TraceEvent(name, track, started, time.time(), False))
            on_error(error)

        return done, failed

    # ---- model ops in seq_id order -------------------------------------------------------------------

    def queue_model_op(
        self,
        kind: str,
        model_id: str,
        seq_id: int | None,
        run: Callable[[Engine], Any],
        encode: Callable[[Any], Payload],
    ) -> JSONResponse:
        if not self.worker.has_model(model_id):
            self.check_session_open(session_of(model_id))
            raise not_found(
                f"{kind}: unknown model_id {model_id!r}; create it with create_lora_training_client or "
                "create_training_client_from_state (models do not survive a server restart; checkpoints do)"
            )
        existing = self.worker.submitted_request(model_id, seq_id)
        if existing is not None:
            return JSONResponse({"request_id": existing, "model_id": model_id})
        request_id = self.futures.create(kind)
        self.registry.touch(model_id)
        done, failed = self._traced(
            session_of(model_id), kind, model_id, self.complete_future(request_id, encode), self.fail_future(request_id)
        )
        job = Job(f"{kind} {model_id}#{seq_id}", run, done, failed)
        try:
            self.worker.submit_model_op(model_id, seq_id, request_id, job)
        except SequenceError as e:
            self.futures.fail(request_id, str(e), "user")
            raise bad_request(str(e)) from e
        return JSONResponse({"request_id": request_id, "model_id": model_id})

    def refuse_model_op(self, model_id: str, seq_id: int | None, error: ProtocolError) -> ProtocolError:
        """A request refused after its seq_id was read: free the slot so later requests still run."""
        self.worker.skip_model_seq(model_id, seq_id)
        return error


def _ignore(_: Any) -> None:
    pass


def _log_release_error(error: BaseException) -> None:
    logger.warning("releasing a finished session's clients failed: %s: %s", type(error).__name__, error)
