"""A training client's sequenced ops: forward(_backward), optim_step and saving its weights.

Each op carries the client's ``seq_id`` and runs strictly in that order on the engine worker; a request
refused after its seq_id was read frees the slot (``ServiceCore.refuse_model_op``) so later ones still run.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from localtinker.engine.api import Engine, ForwardBackwardResult, checkpoint_ttl_problem

from .. import json_codec as jc
from .. import proto_codec
from ..core import PROTOBUF, ServiceCore, session_of
from ..errors import OversizedBody, ProtocolError, bad_request
from ..futures import Payload
from ..registry import SamplerRecord


class TrainingRoutes:
    def __init__(self, core: ServiceCore) -> None:
        self.core = core

    def routes(self) -> list[Route]:
        return [
            self.core.route("forward_backward", self.forward_backward, "POST"),
            self.core.route("optim_step", self.optim_step, "POST"),
            self.core.route("save_weights", self.save_weights, "POST"),
            self.core.route("save_weights_for_sampler", self.save_weights_for_sampler, "POST"),
            self.core.route("save_weights_external", self.save_weights_external, "POST"),
            self.core.route("create_custom_loss", self.create_custom_loss, "POST"),
        ]

    # ---- forward_backward ----------------------------------------------------------------------------

    async def _forward_backward_body(self, request: Request) -> bytes:
        """The decoded body; a refused one (too large, or inflating beyond the limit) still frees its seq_id.

        Without that, the client's next request on the model would wait ``gap_timeout_s`` for a seq_id
        that can never arrive. model_id and seq_id are protobuf fields 1 and 2, so the head of the body
        names them even when the rest was never read.
        """
        compressed = request.headers.get("content-encoding", "").lower() == "zstd"
        try:
            body = await self.core.body(request)
        except OversizedBody as e:
            head = proto_codec.zstd_prefix(e.head) if compressed else e.head
            raise self._refuse_unparsed_forward_backward(head, e) from e
        if not compressed:
            return body
        try:
            return proto_codec.decompress_zstd(body, self.core.config.max_request_bytes)
        except ProtocolError as e:  # malformed, or inflates past the limit
            raise self._refuse_unparsed_forward_backward(proto_codec.zstd_prefix(body), e) from e

    def _refuse_unparsed_forward_backward(self, head: bytes, error: ProtocolError) -> ProtocolError:
        model_id, seq_id = proto_codec.leading_model_and_seq(head)
        if model_id is None:
            return error
        return self.core.refuse_model_op(model_id, seq_id, error)

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
            raise self.core.refuse_model_op(message.model_id, seq_id, e) from e
        kind = "forward" if call.forward_only else "forward_backward"
        num_datums = len(call.data)

        def run(engine: Engine) -> ForwardBackwardResult:
            return engine.forward_backward(call.model_id, call.data, call.loss_fn, call.loss_fn_config, call.forward_only)

        def encode(result: ForwardBackwardResult) -> Payload:
            return Payload(proto_body=proto_codec.encode_forward_backward_output(result, num_datums))

        return self.core.queue_model_op(kind, call.model_id, seq_id, run, encode)

    async def create_custom_loss(self, request: Request) -> Response:
        """Uploaded loss graphs are not run here; client/config says so, and the SDK then runs them itself."""
        await self.core.body(request)
        raise bad_request(
            "create_custom_loss: localtinker does not run uploaded loss graphs (client/config answers "
            "custom_loss_server_side=false); ServiceClient.create_custom_loss then keeps the traced loss "
            "client-side and forward_backward_custom runs it there. Use an unmodified tinker SDK."
        )

    # ---- optimizer -----------------------------------------------------------------------------------

    async def optim_step(self, request: Request) -> Response:
        body = await self.core.json(request, "optim_step")
        model_id = jc.field(body, "model_id", str, "optim_step")
        seq_id = jc.field(body, "seq_id", int, "optim_step", default=None)
        try:
            adam = jc.parse_adam(body)
        except ProtocolError as e:
            raise self.core.refuse_model_op(model_id, seq_id, e) from e
        return self.core.queue_model_op(
            "optim_step",
            model_id,
            seq_id,
            lambda e: e.optim_step(model_id, adam),
            lambda metrics: Payload(
                json_body={"type": "optim_step", "metrics": {str(k): float(v) for k, v in (metrics or {}).items()}}
            ),
        )

    # ---- saving weights ------------------------------------------------------------------------------

    def _checkpoint_name(self, body: dict[str, Any], endpoint: str, model_id: str, seq_id: int | None) -> str:
        try:
            name = jc.field(body, "path", str, endpoint)
            if not name or "/" in name or name.startswith(".") or len(name) > 200:
                raise bad_request(
                    f"{endpoint}: checkpoint name {name!r} must be non-empty, at most 200 characters, "
                    "contain no '/' and not start with '.'"
                )
        except ProtocolError as e:
            raise self.core.refuse_model_op(model_id, seq_id, e) from e
        return name

    def _checkpoint_ttl(self, body: dict[str, Any], endpoint: str, model_id: str, seq_id: int | None) -> int | None:
        try:
            ttl_seconds = jc.field(body, "ttl_seconds", int, endpoint, default=None)
            problem = checkpoint_ttl_problem(ttl_seconds)
            if problem is not None:
                raise bad_request(f"{endpoint}: {problem}")
        except ProtocolError as e:
            raise self.core.refuse_model_op(model_id, seq_id, e) from e
        return ttl_seconds

    async def save_weights(self, request: Request) -> Response:
        endpoint = "save_weights"
        body = await self.core.json(request, endpoint)
        model_id = jc.field(body, "model_id", str, endpoint)
        seq_id = jc.field(body, "seq_id", int, endpoint, default=None)
        name = self._checkpoint_name(body, endpoint, model_id, seq_id)
        ttl_seconds = self._checkpoint_ttl(body, endpoint, model_id, seq_id)
        return self.core.queue_model_op(
            endpoint,
            model_id,
            seq_id,
            lambda e: e.save_state(model_id, name, ttl_seconds),
            lambda path: Payload(json_body={"type": "save_weights", "path": path}),
        )

    async def save_weights_external(self, request: Request) -> Response:
        """The LoRA weights in PEFT's format, for download through signed URLs (routes/weights.py)."""
        endpoint = "save_weights_external"
        body = await self.core.json(request, endpoint)
        model_id = jc.field(body, "model_id", str, endpoint)
        seq_id = jc.field(body, "seq_id", int, endpoint, default=None)
        name = self._checkpoint_name(body, endpoint, model_id, seq_id)
        ttl_seconds = self._checkpoint_ttl(body, endpoint, model_id, seq_id)
        if body.get("age_encryption_recipients"):
            raise self.core.refuse_model_op(
                model_id,
                seq_id,
                bad_request(
                    f"{endpoint}: age_encryption_recipients is not supported by localtinker (exports stay on "
                    "this machine and are served only through signed, expiring URLs); omit it"
                ),
            )
        return self.core.queue_model_op(
            endpoint,
            model_id,
            seq_id,
            lambda e: e.save_external_weights(model_id, name, ttl_seconds),
            lambda path: Payload(json_body={"type": endpoint, "path": path}),
        )

    async def save_weights_for_sampler(self, request: Request) -> Response:
        endpoint = "save_weights_for_sampler"
        core = self.core
        body = await core.json(request, endpoint)
        model_id = jc.field(body, "model_id", str, endpoint)
        seq_id = jc.field(body, "seq_id", int, endpoint, default=None)
        if body.get("path") is not None:
            name = self._checkpoint_name(body, endpoint, model_id, seq_id)
            ttl_seconds = self._checkpoint_ttl(body, endpoint, model_id, seq_id)
            return core.queue_model_op(
                endpoint,
                model_id,
                seq_id,
                lambda e: e.save_sampler_weights(model_id, name, ttl_seconds),
                lambda path: Payload(json_body={"type": endpoint, "path": path}),
            )
        try:
            sampler_seq = jc.field(body, "sampling_session_seq_id", int, endpoint)
        except ProtocolError as e:
            raise core.refuse_model_op(model_id, seq_id, e) from e
        sampler_id = f"{session_of(model_id)}:sample:{sampler_seq}"

        def run(engine: Engine) -> str:
            base_model = engine.create_ephemeral_sampler(sampler_id, model_id)
            core.registry.add_sampler(SamplerRecord(sampler_id, base_model, None))
            return sampler_id

        return core.queue_model_op(
            endpoint, model_id, seq_id, run, lambda sid: Payload(json_body={"type": endpoint, "sampling_session_id": sid})
        )
