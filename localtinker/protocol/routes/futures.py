"""``retrieve_future``: long-polls a request's future; HTTP 408 while pending (the SDK retries it quietly)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import json_codec as jc
from ..core import PROTOBUF, ServiceCore, error_response


class FutureRoutes:
    def __init__(self, core: ServiceCore) -> None:
        self.core = core

    def routes(self) -> list[Route]:
        return [
            self.core.route("retrieve_future", self.retrieve_future, "POST"),
            self.core.route("cancel_future", self.cancel_future, "POST"),
        ]

    async def retrieve_future(self, request: Request) -> Response:
        config = self.core.config
        body = await self.core.json(request, "retrieve_future")
        request_id = jc.field(body, "request_id", str, "retrieve_future")
        entry = await self.core.futures.wait(request_id, config.long_poll_s)
        if entry is None:
            return error_response(
                404,
                f"unknown request_id {request_id!r}: it was never issued by this server, or its result "
                f"expired ({config.result_retention_s:.0f} s after completion)",
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
        await self.core.body(request)
        return JSONResponse({})
