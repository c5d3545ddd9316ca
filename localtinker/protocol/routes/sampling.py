"""Sampling sessions and ``asample``: requests join the engine's batched sample stream on the worker."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localtinker.engine.api import SampleExtras, SampleResult

from .. import json_codec as jc
from .. import proto_codec
from ..core import ServiceCore, session_of_sampler
from ..errors import bad_request, not_found
from ..futures import Payload
from ..registry import SamplerRecord


class SamplingRoutes:
    def __init__(self, core: ServiceCore) -> None:
        self.core = core
        # (sampler, seq_id) -> (request_id, sequence ids): a retried asample gets the same future
        self._sample_requests: dict[tuple[str, int], tuple[str, list[str]]] = {}

    def routes(self) -> list[Route]:
        return [
            self.core.route("create_sampling_session", self.create_sampling_session, "POST"),
            self.core.route("samplers/{sampler_id}", self.get_sampler, "GET"),
            self.core.route("asample", self.asample, "POST"),
        ]

    async def create_sampling_session(self, request: Request) -> Response:
        endpoint = "create_sampling_session"
        body = await self.core.json(request, endpoint)
        session_id = jc.field(body, "session_id", str, endpoint)
        sampler_seq = jc.field(body, "sampling_session_seq_id", int, endpoint)
        base_model = jc.field(body, "base_model", str, endpoint, default=None)
        model_path = jc.field(body, "model_path", str, endpoint, default=None)
        if base_model is None and model_path is None:
            raise bad_request(f"{endpoint}: give base_model or a tinker:// model_path")
        if model_path is not None and "/external_weights/" in model_path:
            raise bad_request(
                f"{endpoint}: {model_path} holds weights exported for download; sample from the "
                "tinker://<run_id>/sampler_weights/<name> (or weights/<name>) checkpoint instead"
            )
        sampler_id = f"{session_id}:sample:{sampler_seq}"
        self.core.check_session_open(session_id)
        if self.core.registry.sampler(sampler_id) is None:
            resolved = await self.core.on_worker(
                f"{endpoint} {sampler_id}", lambda e: e.create_sampler(sampler_id, base_model, model_path)
            )
            self.core.registry.add_sampler(SamplerRecord(sampler_id, resolved, model_path))
        return JSONResponse({"type": endpoint, "sampling_session_id": sampler_id})

    async def get_sampler(self, request: Request) -> Response:
        sampler_id = request.path_params["sampler_id"]
        record = self.core.registry.sampler(sampler_id)
        if record is None:
            raise not_found(f"unknown sampler {sampler_id!r}; create it with create_sampling_client")
        return JSONResponse(
            {"sampler_id": record.sampler_id, "base_model": record.base_model, "model_path": record.model_path}
        )

    async def asample(self, request: Request) -> Response:
        core = self.core
        body = await core.json(request, "asample")
        sampler_id = jc.field(body, "sampling_session_id", str, "asample")
        seq_id = jc.field(body, "seq_id", int, "asample", default=None)
        core.check_session_open(session_of_sampler(sampler_id))  # a finished session's samplers were released
        if core.registry.sampler(sampler_id) is None:
            raise not_found(f"asample: unknown sampling_session_id {sampler_id!r}; create a sampling client first")
        if seq_id is not None and (sampler_id, seq_id) in self._sample_requests:
            request_id, sequence_ids = self._sample_requests[(sampler_id, seq_id)]
            return JSONResponse({"request_id": request_id, "sample_sequence_ids": sequence_ids})
        spec, last_n = jc.parse_sample_spec(body)
        extras = jc.parse_sample_extras(body)
        request_id = core.futures.create("sample")
        sequence_ids = [f"{request_id}:{i}" for i in range(spec.num_samples)]
        if seq_id is not None:
            self._remember_sample_request((sampler_id, seq_id), (request_id, sequence_ids))

        complete, fail = core.complete_future(request_id, lambda payload: payload), core.fail_future(request_id)

        def done(result: SampleResult, found: SampleExtras | None) -> None:
            if len(result.sequences) != spec.num_samples:
                fail(RuntimeError(f"engine returned {len(result.sequences)} sequences for num_samples={spec.num_samples}"))
                return
            complete(Payload(proto_body=proto_codec.encode_sample_response(result, last_n, found)))

        core.submit_sample(sampler_id, spec, extras, done, fail)
        return JSONResponse({"request_id": request_id, "sample_sequence_ids": sequence_ids})

    def _remember_sample_request(self, key: tuple[str, int], value: tuple[str, list[str]]) -> None:
        if len(self._sample_requests) > 100_000:
            for old in list(self._sample_requests)[:50_000]:
                del self._sample_requests[old]
        self._sample_requests[key] = value
