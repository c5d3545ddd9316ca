"""The HTTP face of localtinker: tinker SDK 0.38 wire protocol -> engine calls on the worker thread.

Handlers only decode, validate, queue and encode. Model ops (F endpoints) answer
``{request_id, model_id?}`` at once; the result is fetched through ``retrieve_future``, which
long-polls and answers HTTP 408 while the request is still pending (the SDK retries 408 quietly).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from localtinker.engine.api import (
    CheckpointInfo,
    Engine,
    EngineUserError,
    ForwardBackwardResult,
    LoraSpec,
    ModelInfo,
    SampleResult,
    UnknownModelError,
    checkpoint_ttl_problem,
)

from . import json_codec as jc
from . import proto_codec
from .errors import ProtocolError, bad_request, not_found
from .futures import FutureStore, Payload
from .registry import ModelRecord, Registry, RunRecord, SamplerRecord
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
    # Extra ClientConfigResponse flags sent to SDKs (e.g. a small fwdbwd_max_chunk_len in tests).
    client_config: dict[str, Any] = field(default_factory=dict)


def _error(status: int, message: str, category: str = "user") -> JSONResponse:
    return JSONResponse({"error": message, "category": category}, status_code=status)


def _engine_error_response(e: BaseException) -> JSONResponse:
    if isinstance(e, UnknownModelError):
        return _error(404, str(e))
    if isinstance(e, EngineUserError):
        return _error(400, str(e))
    logger.exception("request failed inside the engine", exc_info=e)
    response = _error(500, f"internal error: {type(e).__name__}: {e}", "server")
    response.headers["x-should-retry"] = "false"  # the same request would fail the same way
    return response


def _iso(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp, tz=dt.timezone.utc).isoformat()


def _session_of(model_id: str) -> str:
    return model_id.rsplit(":train:", 1)[0]


Handler = Callable[[Request], Awaitable[Response]]


class LocalTinkerService:
    """Owns the futures store, the registry and the engine worker; builds the ASGI app."""

    def __init__(self, engine: Engine, storage_dir: Path | None, config: ProtocolConfig = ProtocolConfig()) -> None:
        self.config = config
        self.engine = engine
        self.futures = FutureStore(config.result_retention_s)
        self.registry = Registry(storage_dir)
        self.worker = EngineWorker(
            engine,
            gap_timeout_s=config.gap_timeout_s,
            sample_linger_s=config.sample_linger_s,
            sample_burst_gap_s=config.sample_burst_gap_s,
            sample_linger_max_s=config.sample_linger_max_s,
        )
        self._sample_requests: dict[tuple[str, int], tuple[str, list[str]]] = {}
        self.worker.start()

    def close(self) -> None:
        self.worker.stop()

    # ---- app ---------------------------------------------------------------------------------------

    def build_app(self) -> ASGIApp:
        routes = [
            Route(f"{API}/healthz", self._wrap(self.healthz), methods=["GET"]),
            Route(f"{API}/client/config", self._wrap(self.client_config), methods=["POST"]),
            Route(f"{API}/create_session", self._wrap(self.create_session), methods=["POST"]),
            Route(f"{API}/session_heartbeat", self._wrap(self.session_heartbeat), methods=["POST"]),
            Route(f"{API}/sessions/{{session_id}}/finish", self._wrap(self.finish_session), methods=["POST"]),
            Route(f"{API}/telemetry", self._wrap(self.telemetry), methods=["POST"]),
            Route(f"{API}/get_server_capabilities", self._wrap(self.capabilities), methods=["GET"]),
            Route(f"{API}/create_model", self._wrap(self.create_model), methods=["POST"]),
            Route(f"{API}/get_info", self._wrap(self.get_info), methods=["POST"]),
            Route(f"{API}/load_weights", self._wrap(self.load_weights), methods=["POST"]),
            Route(f"{API}/forward_backward", self._wrap(self.forward_backward), methods=["POST"]),
            Route(f"{API}/optim_step", self._wrap(self.optim_step), methods=["POST"]),
            Route(f"{API}/save_weights", self._wrap(self.save_weights), methods=["POST"]),
            Route(f"{API}/save_weights_for_sampler", self._wrap(self.save_weights_for_sampler), methods=["POST"]),
            Route(f"{API}/create_sampling_session", self._wrap(self.create_sampling_session), methods=["POST"]),
            Route(f"{API}/samplers/{{sampler_id}}", self._wrap(self.get_sampler), methods=["GET"]),
            Route(f"{API}/asample", self._wrap(self.asample), methods=["POST"]),
            Route(f"{API}/retrieve_future", self._wrap(self.retrieve_future), methods=["POST"]),
            Route(f"{API}/cancel_future", self._wrap(self.cancel_future), methods=["POST"]),
            Route(f"{API}/training_runs", self._wrap(self.list_training_runs), methods=["GET"]),
            Route(f"{API}/training_runs/{{run_id}}", self._wrap(self.get_training_run), methods=["GET"]),
            Route(f"{API}/training_runs/{{run_id}}/checkpoints", self._wrap(self.list_run_checkpoints), methods=["GET"]),
            Route(
                f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}",
                self._wrap(self.delete_checkpoint),
                methods=["DELETE"],
            ),
            Route(
                f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/ttl",
                self._wrap(self.set_checkpoint_ttl),
                methods=["PUT"],
            ),
            Route(f"{API}/checkpoints", self._wrap(self.list_user_checkpoints), methods=["GET"]),
            Route(f"{API}/weights_info", self._wrap(self.weights_info), methods=["POST"]),
            Route(f"{API}/create_custom_loss", self._wrap(self.create_custom_loss), methods=["POST"]),
        ]
        app = Starlette(routes=routes)
        return GuardMiddleware(app, api_key=self.config.api_key, max_request_bytes=self.config.max_request_bytes)

    @staticmethod
    def _wrap(handler: Handler) -> Handler:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except ProtocolError as e:
                return _error(e.status, e.message)
            except EngineUserError as e:
                return _engine_error_response(e)
            except Exception as e:  # noqa: BLE001 - a bad request must never take the server down
                return _engine_error_response(e)

        return endpoint

    async def _body(self, request: Request) -> bytes:
        """The whole body; stops reading at the size limit and raises a 413 that keeps what was read."""
        limit = self.config.max_request_bytes
        chunks, size = [], 0
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise OversizedBody(limit, b"".join(chunks))
        return b"".join(chunks)

    async def _json(self, request: Request, endpoint: str) -> dict[str, Any]:
        return jc.parse_json_object(await self._body(request), endpoint)

    async def _on_worker(self, describe: str, run: Callable[[Engine], Any]) -> Any:
        return await asyncio.wrap_future(self.worker.call(describe, run))

    # ---- futures plumbing ----------------------------------------------------------------------------

    def _fail_future(self, request_id: str) -> Callable[[BaseException], None]:
        def on_error(e: BaseException) -> None:
            if isinstance(e, EngineUserError):
                self.futures.fail(request_id, str(e), "user")
            else:
                self.futures.fail(request_id, f"internal error: {type(e).__name__}: {e}", "server")

        return on_error

    def _complete_future(self, request_id: str, encode: Callable[[Any], Payload]) -> Callable[[Any], None]:
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

    def _queue_model_op(
        self,
        kind: str,
        model_id: str,
        seq_id: int | None,
        run: Callable[[Engine], Any],
        encode: Callable[[Any], Payload],
    ) -> JSONResponse:
        if not self.worker.has_model(model_id):
            raise not_found(
                f"{kind}: unknown model_id {model_id!r}; create it with create_lora_training_client or "
                "create_training_client_from_state (models do not survive a server restart; checkpoints do)"
            )
        existing = self.worker.submitted_request(model_id, seq_id)
        if existing is not None:
            return JSONResponse({"request_id": existing, "model_id": model_id})
        request_id = self.futures.create(kind)
        self.registry.touch(model_id)
        job = Job(
            f"{kind} {model_id}#{seq_id}",
            run,
            self._complete_future(request_id, encode),
            self._fail_future(request_id),
        )
        try:
            self.worker.submit_model_op(model_id, seq_id, request_id, job)
        except SequenceError as e:
            self.futures.fail(request_id, str(e), "user")
            raise bad_request(str(e)) from e
        return JSONResponse({"request_id": request_id, "model_id": model_id})

    def _refuse_model_op(self, model_id: str, seq_id: int | None, error: ProtocolError) -> ProtocolError:
        """A request refused after its seq_id was read: free the slot so later requests still run."""
        self.worker.skip_model_seq(model_id, seq_id)
        return error

    # ---- session endpoints ----------------------------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def client_config(self, request: Request) -> Response:
        await self._body(request)
        return JSONResponse(
            {
                "pjwt_auth_enabled": False,
                "use_pyqwest_transport": False,
                "parallel_fwdbwd_chunks": True,
                "proto_compress_fwdbwd": False,
                "fwdbwd_max_chunk_bytes_count": min(5_000_000, self.config.max_request_bytes // 2),
                "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False,
                "sample_join_sampling_session": False,
                **self.config.client_config,
            }
        )

    async def create_session(self, request: Request) -> Response:
        await self._json(request, "create_session")
        record = self.registry.new_session()
        return JSONResponse({"type": "create_session", "session_id": record.session_id})

    async def session_heartbeat(self, request: Request) -> Response:
        body = await self._json(request, "session_heartbeat")
        session = self.registry.session(str(body.get("session_id")))
        if session is not None and session.finished:
            return _error(410, f"session {session.session_id} has finished ({session.finished})")
        if session is not None:
            session.last_heartbeat = time.time()
        return JSONResponse({"type": "session_heartbeat"})

    async def finish_session(self, request: Request) -> Response:
        body = await self._json(request, "sessions/finish")
        session = self.registry.session(request.path_params["session_id"])
        if session is not None and session.finished is None:
            reason = body.get("reason")
            session.finished = str(reason.get("type")) if isinstance(reason, dict) else "success"
        return JSONResponse({})

    async def telemetry(self, request: Request) -> Response:
        await self._body(request)
        return JSONResponse({"status": "accepted"})

    async def capabilities(self, request: Request) -> Response:
        models: list[ModelInfo] = await self._on_worker("supported_models", lambda e: e.supported_models())
        return JSONResponse(
            {
                "supported_models": [
                    {
                        "model_name": info.base_model,
                        "max_context_length": info.max_context_length,
                        "trainable": True,
                        "sampleable": True,
                    }
                    for info in models
                ]
            }
        )

    # ---- training models ---------------------------------------------------------------------------------

    def _new_model_record(
        self, model_id: str, request_id: str, base_model: str, lora: LoraSpec | None, body: dict[str, Any]
    ) -> ModelRecord:
        metadata = body.get("user_metadata") or {}
        now = time.time()
        lora = lora or LoraSpec(rank=0)  # create-from-state: the engine reports the checkpoint's rank
        run = RunRecord(
            training_run_id=model_id,
            base_model=base_model,
            lora_rank=lora.rank,
            created_at=now,
            last_request_time=now,
            user_metadata={str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else {},
            train_unembed=lora.train_unembed,
            train_mlp=lora.train_mlp,
            train_attn=lora.train_attn,
        )
        return ModelRecord(model_id=model_id, create_request_id=request_id, run=run)

    def _model_id_from(self, body: dict[str, Any], endpoint: str) -> str:
        session_id = jc.field(body, "session_id", str, endpoint)
        model_seq_id = jc.field(body, "model_seq_id", int, endpoint)
        if model_seq_id < 0:
            raise bad_request(f"{endpoint}: model_seq_id={model_seq_id} must be >= 0")
        return f"{session_id}:train:{model_seq_id}"

    def _queue_model_creation(
        self,
        kind: str,
        model_id: str,
        record_args: tuple[str, LoraSpec | None, dict[str, Any]],
        run: Callable[[Engine], ModelInfo],
        answer: Callable[[ModelInfo], dict[str, Any]],
    ) -> JSONResponse:
        existing = self.registry.model(model_id)
        if existing is not None:
            return JSONResponse({"request_id": existing.create_request_id, "model_id": model_id})
        request_id = self.futures.create(kind)
        base_model, lora, body = record_args
        record = self.registry.add_model(self._new_model_record(model_id, request_id, base_model, lora, body))
        if record.create_request_id != request_id:  # a concurrent duplicate won the race
            return JSONResponse({"request_id": record.create_request_id, "model_id": model_id})
        self.worker.register_model(model_id)

        def on_done(info: ModelInfo) -> None:
            self.registry.model_created(model_id, info)
            self.futures.complete(request_id, Payload(json_body=answer(info)))

        def on_error(e: BaseException) -> None:
            self.registry.drop_model(model_id)
            self.worker.forget_model(model_id)
            self._fail_future(request_id)(e)

        self.worker.submit_control(Job(f"{kind} {model_id}", run, on_done, on_error))
        return JSONResponse({"request_id": request_id, "model_id": model_id})

    async def create_model(self, request: Request) -> Response:
        endpoint = "create_model"
        body = await self._json(request, endpoint)
        model_id = self._model_id_from(body, endpoint)
        base_model = jc.field(body, "base_model", str, endpoint)
        lora = jc.parse_lora(body, endpoint)
        jc.check_optimizer_config(body, endpoint)
        return self._queue_model_creation(
            endpoint,
            model_id,
            (base_model, lora, body),
            lambda e: e.create_model(model_id, base_model, lora),
            lambda info: {"type": "create_model", "model_id": model_id},
        )

    async def get_info(self, request: Request) -> Response:
        body = await self._json(request, "get_info")
        model_id = jc.field(body, "model_id", str, "get_info")
        record = self.registry.model(model_id)
        if record is None:
            raise not_found(f"get_info: unknown model_id {model_id!r}")
        info = record.info or await self._on_worker("get_info", lambda e: e.get_info(model_id))
        return JSONResponse(
            {
                "type": "get_info",
                "model_id": model_id,
                "model_data": {"arch": info.arch, "model_name": info.base_model, "tokenizer_id": info.tokenizer_id},
                "is_lora": True,
                "lora_rank": info.lora_rank,
                "model_name": info.base_model,
            }
        )

    async def load_weights(self, request: Request) -> Response:
        endpoint = "load_weights"
        body = await self._json(request, endpoint)
        if body.get("session_id") is None:  # TrainingClient.load_state: an in-place load, deprecated by the SDK
            model_id = jc.field(body, "model_id", str, endpoint)
            seq_id = jc.field(body, "seq_id", int, endpoint, default=None)
            raise self._refuse_model_op(
                model_id,
                seq_id,
                bad_request(
                    "load_weights into an existing training client (TrainingClient.load_state*, deprecated by "
                    "the SDK) is not supported; create a new client with ServiceClient."
                    "create_training_client_from_state(path) or ..._with_optimizer(path)"
                ),
            )
        # create-from-state: the load creates a new training client
        path = jc.field(body, "path", str, endpoint)
        with_optimizer = jc.field(body, "optimizer", bool, endpoint, default=False)
        model_id = self._model_id_from(body, endpoint)
        base_model = jc.field(body, "base_model", str, endpoint, default=None)
        if with_optimizer and body.get("optimizer_config") is not None:
            raise bad_request(f"{endpoint}: optimizer_config cannot override a restored optimizer state")
        jc.check_optimizer_config(body, endpoint)
        return self._queue_model_creation(
            endpoint,
            model_id,
            (base_model or "", None, body),
            lambda e: e.load_state(model_id, path, with_optimizer, base_model),
            lambda info: {"type": "load_weights", "path": path, "model_id": model_id},
        )

    async def _forward_backward_body(self, request: Request) -> bytes:
        """The decoded body; a refused one (too large, or inflating beyond the limit) still frees its seq_id.

        Without that, the client's next request on the model would wait ``gap_timeout_s`` for a seq_id
        that can never arrive. model_id and seq_id are protobuf fields 1 and 2, so the head of the body
        names them even when the rest was never read.
        """
        compressed = request.headers.get("content-encoding", "").lower() == "zstd"
        try:
            body = await self._body(request)
        except OversizedBody as e:
            head = proto_codec.zstd_prefix(e.head) if compressed else e.head
            raise self._refuse_unparsed_forward_backward(head, e) from e
        if not compressed:
            return body
        try:
            return proto_codec.decompress_zstd(body, self.config.max_request_bytes)
        except ProtocolError as e:  # malformed, or inflates past the limit
            raise self._refuse_unparsed_forward_backward(proto_codec.zstd_prefix(body), e) from e

    def _refuse_unparsed_forward_backward(self, head: bytes, error: ProtocolError) -> ProtocolError:
        model_id, seq_id = proto_codec.leading_model_and_seq(head)
        if model_id is None:
            return error
        return self._refuse_model_op(model_id, seq_id, error)

    async def forward_backward(self, request: Request) -> Response:
        content_type = request.headers.get("content-type", "")
        if PROTOBUF not in content_type:
            raise ProtocolError(
                415,
                f"forward_backward takes a protobuf ForwardBackwardRequest (Content-Type: {PROTOBUF}), "
                f"got {content_type or 'no content type'}",
            )
        body = await self._forward_backward_body(request)
        message = proto_codec.parse_forward_backward(body)
        seq_id = message.seq_id if message.seq_id > 0 else None
        try:
            call = proto_codec.forward_backward_call(message)
            jc.check_loss_fn(call.loss_fn)
        except ProtocolError as e:
            raise self._refuse_model_op(message.model_id, seq_id, e) from e
        kind = "forward" if call.forward_only else "forward_backward"
        num_datums = len(call.data)

        def run(engine: Engine) -> ForwardBackwardResult:
            return engine.forward_backward(call.model_id, call.data, call.loss_fn, call.loss_fn_config, call.forward_only)

        def encode(result: ForwardBackwardResult) -> Payload:
            return Payload(proto_body=proto_codec.encode_forward_backward_output(result, num_datums))

        return self._queue_model_op(kind, call.model_id, seq_id, run, encode)

    async def optim_step(self, request: Request) -> Response:
        body = await self._json(request, "optim_step")
        model_id = jc.field(body, "model_id", str, "optim_step")
        seq_id = jc.field(body, "seq_id", int, "optim_step", default=None)
        try:
            adam = jc.parse_adam(body)
        except ProtocolError as e:
            raise self._refuse_model_op(model_id, seq_id, e) from e
        return self._queue_model_op(
            "optim_step",
            model_id,
            seq_id,
            lambda e: e.optim_step(model_id, adam),
            lambda metrics: Payload(
                json_body={"type": "optim_step", "metrics": {str(k): float(v) for k, v in (metrics or {}).items()}}
            ),
        )

    def _checkpoint_name(self, body: dict[str, Any], endpoint: str, model_id: str, seq_id: int | None) -> str:
        try:
            name = jc.field(body, "path", str, endpoint)
            if not name or "/" in name or name.startswith(".") or len(name) > 200:
                raise bad_request(
                    f"{endpoint}: checkpoint name {name!r} must be non-empty, at most 200 characters, "
                    "contain no '/' and not start with '.'"
                )
        except ProtocolError as e:
            raise self._refuse_model_op(model_id, seq_id, e) from e
        return name

    def _checkpoint_ttl(self, body: dict[str, Any], endpoint: str, model_id: str, seq_id: int | None) -> int | None:
        try:
            ttl_seconds = jc.field(body, "ttl_seconds", int, endpoint, default=None)
            problem = checkpoint_ttl_problem(ttl_seconds)
            if problem is not None:
                raise bad_request(f"{endpoint}: {problem}")
        except ProtocolError as e:
            raise self._refuse_model_op(model_id, seq_id, e) from e
        return ttl_seconds

    async def save_weights(self, request: Request) -> Response:
        endpoint = "save_weights"
        body = await self._json(request, endpoint)
        model_id = jc.field(body, "model_id", str, endpoint)
        seq_id = jc.field(body, "seq_id", int, endpoint, default=None)
        name = self._checkpoint_name(body, endpoint, model_id, seq_id)
        ttl_seconds = self._checkpoint_ttl(body, endpoint, model_id, seq_id)
        return self._queue_model_op(
            endpoint,
            model_id,
            seq_id,
            lambda e: e.save_state(model_id, name, ttl_seconds),
            lambda path: Payload(json_body={"type": "save_weights", "path": path}),
        )

    async def save_weights_for_sampler(self, request: Request) -> Response:
        endpoint = "save_weights_for_sampler"
        body = await self._json(request, endpoint)
        model_id = jc.field(body, "model_id", str, endpoint)
        seq_id = jc.field(body, "seq_id", int, endpoint, default=None)
        if body.get("path") is not None:
            name = self._checkpoint_name(body, endpoint, model_id, seq_id)
            ttl_seconds = self._checkpoint_ttl(body, endpoint, model_id, seq_id)
            return self._queue_model_op(
                endpoint,
                model_id,
                seq_id,
                lambda e: e.save_sampler_weights(model_id, name, ttl_seconds),
                lambda path: Payload(json_body={"type": endpoint, "path": path}),
            )
        try:
            sampler_seq = jc.field(body, "sampling_session_seq_id", int, endpoint)
        except ProtocolError as e:
            raise self._refuse_model_op(model_id, seq_id, e) from e
        sampler_id = f"{_session_of(model_id)}:sample:{sampler_seq}"

        def run(engine: Engine) -> str:
            base_model = engine.create_ephemeral_sampler(sampler_id, model_id)
            self.registry.add_sampler(SamplerRecord(sampler_id, base_model, None))
            return sampler_id

        return self._queue_model_op(
            endpoint, model_id, seq_id, run, lambda sid: Payload(json_body={"type": endpoint, "sampling_session_id": sid})
        )

    # ---- sampling -----------------------------------------------------------------------------------------------

    async def create_sampling_session(self, request: Request) -> Response:
        endpoint = "create_sampling_session"
        body = await self._json(request, endpoint)
        session_id = jc.field(body, "session_id", str, endpoint)
        sampler_seq = jc.field(body, "sampling_session_seq_id", int, endpoint)
        base_model = jc.field(body, "base_model", str, endpoint, default=None)
        model_path = jc.field(body, "model_path", str, endpoint, default=None)
        if base_model is None and model_path is None:
            raise bad_request(f"{endpoint}: give base_model or a tinker:// model_path")
        sampler_id = f"{session_id}:sample:{sampler_seq}"
        if self.registry.sampler(sampler_id) is None:
            resolved = await self._on_worker(
                f"{endpoint} {sampler_id}", lambda e: e.create_sampler(sampler_id, base_model, model_path)
            )
            self.registry.add_sampler(SamplerRecord(sampler_id, resolved, model_path))
        return JSONResponse({"type": endpoint, "sampling_session_id": sampler_id})

    async def get_sampler(self, request: Request) -> Response:
        sampler_id = request.path_params["sampler_id"]
        record = self.registry.sampler(sampler_id)
        if record is None:
            raise not_found(f"unknown sampler {sampler_id!r}; create it with create_sampling_client")
        return JSONResponse(
            {"sampler_id": record.sampler_id, "base_model": record.base_model, "model_path": record.model_path}
        )

    async def asample(self, request: Request) -> Response:
        body = await self._json(request, "asample")
        sampler_id = jc.field(body, "sampling_session_id", str, "asample")
        seq_id = jc.field(body, "seq_id", int, "asample", default=None)
        if self.registry.sampler(sampler_id) is None:
            raise not_found(f"asample: unknown sampling_session_id {sampler_id!r}; create a sampling client first")
        if seq_id is not None and (sampler_id, seq_id) in self._sample_requests:
            request_id, sequence_ids = self._sample_requests[(sampler_id, seq_id)]
            return JSONResponse({"request_id": request_id, "sample_sequence_ids": sequence_ids})
        spec, last_n = jc.parse_sample_spec(body)
        request_id = self.futures.create("sample")
        sequence_ids = [f"{request_id}:{i}" for i in range(spec.num_samples)]
        if seq_id is not None:
            self._remember_sample_request((sampler_id, seq_id), (request_id, sequence_ids))

        def encode(result: SampleResult) -> Payload:
            if len(result.sequences) != spec.num_samples:
                raise RuntimeError(f"engine returned {len(result.sequences)} sequences for num_samples={spec.num_samples}")
            return Payload(proto_body=proto_codec.encode_sample_response(result, last_n))

        self.worker.submit_sample(
            SampleJob(sampler_id, spec, self._complete_future(request_id, encode), self._fail_future(request_id))
        )
        return JSONResponse({"request_id": request_id, "sample_sequence_ids": sequence_ids})

    def _remember_sample_request(self, key: tuple[str, int], value: tuple[str, list[str]]) -> None:
        if len(self._sample_requests) > 100_000:
            for old in list(self._sample_requests)[:50_000]:
                del self._sample_requests[old]
        self._sample_requests[key] = value

    # ---- futures -------------------------------------------------------------------------------------------------

    async def retrieve_future(self, request: Request) -> Response:
        body = await self._json(request, "retrieve_future")
        request_id = jc.field(body, "request_id", str, "retrieve_future")
        entry = await self.futures.wait(request_id, self.config.long_poll_s)
        if entry is None:
            return _error(
                404,
                f"unknown request_id {request_id!r}: it was never issued by this server, or its result "
                f"expired ({self.config.result_retention_s:.0f} s after completion)",
            )
        if entry.state == "pending":
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"}, status_code=408)
        if entry.state == "failed":
            return JSONResponse({"error": entry.error, "category": entry.category})
        assert entry.payload is not None
        if entry.payload.proto_body is not None:
            return Response(entry.payload.proto_body, media_type=PROTOBUF)
        return JSONResponse(entry.payload.json_body)

    async def cancel_future(self, request: Request) -> Response:
        await self._body(request)
        return JSONResponse({})

    # ---- training runs and checkpoints ---------------------------------------------------------------------------

    def _checkpoint_json(self, info: CheckpointInfo) -> dict[str, Any]:
        return {
            "checkpoint_id": f"{info.kind}/{info.name}",
            "checkpoint_type": "training" if info.kind == "weights" else "sampler",
            "time": _iso(info.created_at),
            "tinker_path": info.tinker_path,
            "size_bytes": info.size_bytes,
            "expires_at": None if info.expires_at is None else _iso(info.expires_at),
        }

    async def _checkpoints(self, run_id: str | None) -> list[CheckpointInfo]:
        infos: list[CheckpointInfo] = await self._on_worker("list_checkpoints", lambda e: e.list_checkpoints(run_id))
        return sorted(infos, key=lambda c: c.created_at, reverse=True)

    async def _run_json(self, run: RunRecord) -> dict[str, Any]:
        checkpoints = await self._checkpoints(run.training_run_id)
        last = {kind: next((c for c in checkpoints if c.kind == kind), None) for kind in ("weights", "sampler_weights")}
        return {
            "training_run_id": run.training_run_id,
            "base_model": run.base_model,
            "model_owner": "local",
            "is_lora": True,
            "corrupted": False,
            "lora_rank": run.lora_rank,
            "last_request_time": _iso(run.last_request_time),
            "last_checkpoint": self._checkpoint_json(last["weights"]) if last["weights"] else None,
            "last_sampler_checkpoint": self._checkpoint_json(last["sampler_weights"]) if last["sampler_weights"] else None,
            "user_metadata": run.user_metadata or None,
        }

    async def list_training_runs(self, request: Request) -> Response:
        limit, offset = _page(request, default_limit=20)
        runs = self.registry.all_runs()
        page = [await self._run_json(run) for run in runs[offset : offset + limit]]
        return JSONResponse({"training_runs": page, "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}})

    async def get_training_run(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        run = self.registry.run(run_id)
        if run is None:
            raise not_found(f"unknown training run {run_id!r}")
        return JSONResponse(await self._run_json(run))

    async def list_run_checkpoints(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        checkpoints = await self._checkpoints(run_id)
        return JSONResponse({"checkpoints": [self._checkpoint_json(c) for c in checkpoints], "cursor": None})

    async def list_user_checkpoints(self, request: Request) -> Response:
        limit, offset = _page(request, default_limit=100)
        checkpoints = await self._checkpoints(None)
        return JSONResponse(
            {
                "checkpoints": [self._checkpoint_json(c) for c in checkpoints[offset : offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(checkpoints)},
            }
        )

    async def delete_checkpoint(self, request: Request) -> Response:
        path = f"tinker://{request.path_params['run_id']}/{request.path_params['checkpoint_id']}"
        await self._on_worker(f"delete_checkpoint {path}", lambda e: e.delete_checkpoint(path))
        return JSONResponse({})

    async def create_custom_loss(self, request: Request) -> Response:
        """Uploaded loss graphs are not run here; client/config says so, and the SDK then runs them itself."""
        await self._body(request)
        raise bad_request(
            "create_custom_loss: localtinker does not run uploaded loss graphs (client/config answers "
            "custom_loss_server_side=false); ServiceClient.create_custom_loss then keeps the traced loss "
            "client-side and forward_backward_custom runs it there. Use an unmodified tinker SDK."
        )

    async def set_checkpoint_ttl(self, request: Request) -> Response:
        endpoint = "checkpoints/ttl"
        body = await self._json(request, endpoint)
        if "ttl_seconds" not in body:
            raise bad_request(f"{endpoint}: send {{\"ttl_seconds\": seconds}} (or null to never expire)")
        ttl_seconds = jc.field(body, "ttl_seconds", int, endpoint, default=None)
        problem = checkpoint_ttl_problem(ttl_seconds)
        if problem is not None:
            raise bad_request(f"{endpoint}: {problem}")
        path = f"tinker://{request.path_params['run_id']}/{request.path_params['checkpoint_id']}"
        await self._on_worker(f"set_checkpoint_ttl {path}", lambda e: e.set_checkpoint_ttl(path, ttl_seconds))
        return JSONResponse({})

    async def weights_info(self, request: Request) -> Response:
        body = await self._json(request, "weights_info")
        path = jc.field(body, "tinker_path", str, "weights_info")
        parts = path.removeprefix("tinker://").split("/")
        run = self.registry.run(parts[0]) if path.startswith("tinker://") and len(parts) == 3 else None
        if run is None:
            raise not_found(f"weights_info: no training run is recorded for {path!r}")
        return JSONResponse(
            {
                "base_model": run.base_model,
                "is_lora": True,
                "lora_rank": run.lora_rank,
                "train_unembed": run.train_unembed,
                "train_mlp": run.train_mlp,
                "train_attn": run.train_attn,
            }
        )


class OversizedBody(ProtocolError):
    """A 413 for a body over the limit; ``head`` is what was read before refusing (at most one chunk over)."""

    def __init__(self, limit: int, head: bytes) -> None:
        super().__init__(413, f"request body exceeds the {limit}-byte limit; send smaller requests")
        self.head = head


# Paths whose handler enforces the size limit itself: it reads the head of an oversized body to free
# the request's seq_id before refusing it, so the middleware must not refuse it unread.
SIZE_CHECKED_BY_HANDLER = frozenset({f"{API}/forward_backward"})


def _page(request: Request, default_limit: int) -> tuple[int, int]:
    try:
        limit = int(request.query_params.get("limit", default_limit))
        offset = int(request.query_params.get("offset", 0))
    except ValueError as e:
        raise bad_request(f"limit and offset must be integers: {e}") from e
    if limit < 0 or offset < 0:
        raise bad_request("limit and offset must be >= 0")
    return limit, offset


class GuardMiddleware:
    """API key check, request size limit and one INFO log line per request (never headers or bodies)."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_request_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_logged(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send_logged)
            else:
                await self.app(scope, receive, send_logged)
        finally:
            logger.info(
                "%s %s %d %.1fms", scope["method"], scope["path"], status, (time.perf_counter() - started) * 1000
            )

    def _refusal(self, scope: Scope) -> Response | None:
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"] != f"{API}/healthz":
            given = headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(given, self.api_key):
                what = "is missing" if not given else "is wrong"
                return _error(401, f"the X-API-Key header {what}; set TINKER_API_KEY to the server's --api-key")
        length = headers.get(b"content-length")
        if length is not None and scope["path"] not in SIZE_CHECKED_BY_HANDLER:
            try:
                too_big = int(length) > self.max_request_bytes
            except ValueError:
                return _error(400, "Content-Length is not an integer")
            if too_big:
                return _error(413, f"request body exceeds the {self.max_request_bytes}-byte limit; send smaller requests")
        return None
