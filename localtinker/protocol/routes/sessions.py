"""Start-up, sessions and heartbeats, server capabilities, and creating training models (fresh or from state)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localtinker.engine.api import Engine, LoraSpec, ModelInfo

from .. import json_codec as jc
from ..core import ServiceCore, error_response, session_of
from ..errors import ProtocolError, bad_request, not_found
from ..futures import Payload
from ..registry import ModelRecord, RunRecord
from ..worker import Job


class SessionRoutes:
    def __init__(self, core: ServiceCore) -> None:
        self.core = core

    def routes(self) -> list[Route]:
        return [
            self.core.route("healthz", self.healthz, "GET"),
            self.core.route("client/config", self.client_config, "POST"),
            self.core.route("create_session", self.create_session, "POST"),
            self.core.route("session_heartbeat", self.session_heartbeat, "POST"),
            self.core.route("sessions/{session_id}/finish", self.finish_session, "POST"),
            self.core.route("telemetry", self.telemetry, "POST"),
            self.core.route("get_server_capabilities", self.capabilities, "GET"),
            self.core.route("create_model", self.create_model, "POST"),
            self.core.route("get_info", self.get_info, "POST"),
            self.core.route("load_weights", self.load_weights, "POST"),
        ]

    # ---- sessions ------------------------------------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def client_config(self, request: Request) -> Response:
        await self.core.body(request)
        return JSONResponse(
            {
                "pjwt_auth_enabled": False,
                "use_pyqwest_transport": False,
                "parallel_fwdbwd_chunks": True,
                "proto_compress_fwdbwd": False,
                "fwdbwd_max_chunk_bytes_count": min(5_000_000, self.core.config.max_request_bytes // 2),
                "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False,
                "sample_join_sampling_session": False,
                **self.core.config.client_config,
            }
        )

    async def create_session(self, request: Request) -> Response:
        body = await self.core.json(request, "create_session")
        metadata = body.get("user_metadata")
        display_name = body.get("display_name")
        self.core.expire_silent_sessions()
        record = self.core.registry.new_session(
            {str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else None,
            display_name if isinstance(display_name, str) and display_name else None,
        )
        return JSONResponse({"type": "create_session", "session_id": record.session_id})

    async def session_heartbeat(self, request: Request) -> Response:
        body = await self.core.json(request, "session_heartbeat")
        session = self.core.registry.session(str(body.get("session_id")))
        if session is not None and session.finished is None:
            session.last_heartbeat, session.last_seen = time.time(), time.monotonic()
        self.core.expire_silent_sessions()
        gone = self.core.session_gone(session.session_id) if session is not None else None
        if gone is not None:  # the SDK stops heartbeating on a 410
            return error_response(gone.status, gone.message)
        return JSONResponse({"type": "session_heartbeat"})

    async def finish_session(self, request: Request) -> Response:
        body = await self.core.json(request, "sessions/finish")
        session = self.core.registry.session(request.path_params["session_id"])
        if session is not None:
            reason = body.get("reason")
            self.core.finish_session(session, str(reason.get("type")) if isinstance(reason, dict) else "success")
        return JSONResponse({})

    async def telemetry(self, request: Request) -> Response:
        await self.core.body(request)
        return JSONResponse({"status": "accepted"})

    async def capabilities(self, request: Request) -> Response:
        models: list[ModelInfo] = await self.core.on_worker("supported_models", lambda e: e.supported_models())
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

    # ---- training models -----------------------------------------------------------------------------

    @staticmethod
    def _new_model_record(
        model_id: str, request_id: str, base_model: str, lora: LoraSpec | None, body: dict[str, Any]
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
        """The new training model's id; a 410 when its session has finished (no new clients in it)."""
        session_id = jc.field(body, "session_id", str, endpoint)
        model_seq_id = jc.field(body, "model_seq_id", int, endpoint)
        if model_seq_id < 0:
            raise bad_request(f"{endpoint}: model_seq_id={model_seq_id} must be >= 0")
        self.core.check_session_open(session_id)
        return f"{session_id}:train:{model_seq_id}"

    def _queue_model_creation(
        self,
        kind: str,
        model_id: str,
        record_args: tuple[str, LoraSpec | None, dict[str, Any]],
        run: Callable[[Engine], ModelInfo],
        answer: Callable[[ModelInfo], dict[str, Any]],
    ) -> JSONResponse:
        core = self.core
        existing = core.registry.model(model_id)
        if existing is not None:
            return JSONResponse({"request_id": existing.create_request_id, "model_id": model_id})
        request_id = core.futures.create(kind)
        base_model, lora, body = record_args
        record = core.registry.add_model(self._new_model_record(model_id, request_id, base_model, lora, body))
        if record.create_request_id != request_id:  # a concurrent duplicate won the race
            return JSONResponse({"request_id": record.create_request_id, "model_id": model_id})
        core.worker.register_model(model_id)

        def on_done(info: ModelInfo) -> None:
            core.registry.model_created(model_id, info)
            core.futures.complete(request_id, Payload(json_body=answer(info)))

        def on_error(e: BaseException) -> None:
            core.registry.drop_model(model_id)
            core.worker.forget_model(model_id)
            core.fail_future(request_id)(e)

        core.worker.submit_control(Job(f"{kind} {model_id}", run, on_done, on_error))
        return JSONResponse({"request_id": request_id, "model_id": model_id})

    async def create_model(self, request: Request) -> Response:
        endpoint = "create_model"
        body = await self.core.json(request, endpoint)
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
        body = await self.core.json(request, "get_info")
        model_id = jc.field(body, "model_id", str, "get_info")
        record = self.core.registry.model(model_id)
        if record is None:
            self.core.check_session_open(session_of(model_id))
            raise not_found(f"get_info: unknown model_id {model_id!r}")
        info = record.info or await self.core.on_worker("get_info", lambda e: e.get_info(model_id))
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
        body = await self.core.json(request, endpoint)
        if body.get("session_id") is None:  # TrainingClient.load_state*: an in-place load, deprecated by the SDK
            model_id = jc.field(body, "model_id", str, endpoint)
            seq_id = jc.field(body, "seq_id", int, endpoint, default=None)
            try:
                path = jc.field(body, "path", str, endpoint)
                with_optimizer = jc.field(body, "optimizer", bool, endpoint, default=False)
            except ProtocolError as e:
                raise self.core.refuse_model_op(model_id, seq_id, e) from e
            return self.core.queue_model_op(
                endpoint,
                model_id,
                seq_id,
                lambda e: e.load_state_into(model_id, path, with_optimizer),
                lambda _: Payload(json_body={"type": "load_weights", "path": path}),
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
