"""The outermost ASGI layer: API key check, request size limit and one INFO log line per request."""

from __future__ import annotations

import hmac
import logging
import time

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .core import API, error_response
from .openai_api import OpenAIError

logger = logging.getLogger("localtinker.protocol")

# Signed download URLs carry their own unguessable, expiring token instead of the API key (routes/weights.py).
KEYLESS_PREFIXES = (f"{API}/healthz", "/downloads/")

OPENAI_PREFIX = "/oai/"  # routes/openai.py

# Paths whose handler enforces the size limit itself: it reads the head of an oversized body to free
# the request's seq_id before refusing it, so the middleware must not refuse it unread.
SIZE_CHECKED_BY_HANDLER = frozenset({f"{API}/forward_backward"})


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

    def _key_refusal(self, path: str, headers: dict[bytes, bytes]) -> Response | None:
        given = headers.get(b"x-api-key", b"")
        openai = path.startswith(OPENAI_PREFIX)
        if openai and not given:  # OpenAI clients send the key as a bearer token
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            given = token.strip() if scheme.lower() == b"bearer" else b""
        assert self.api_key is not None
        if hmac.compare_digest(given, self.api_key):
            return None
        what = "is missing" if not given else "is wrong"
        if openai:
            return OpenAIError(
                401, f"the API key {what}; pass the server's --api-key as the OpenAI client's api_key",
                code="invalid_api_key",
            ).response()
        return error_response(401, f"the X-API-Key header {what}; set TINKER_API_KEY to the server's --api-key")

    def _refusal(self, scope: Scope) -> Response | None:
        headers = dict(scope["headers"])
        if self.api_key is not None and not scope["path"].startswith(KEYLESS_PREFIXES):
            refusal = self._key_refusal(scope["path"], headers)
            if refusal is not None:
                return refusal
        length = headers.get(b"content-length")
        if length is not None and scope["path"] not in SIZE_CHECKED_BY_HANDLER:
            try:
                too_big = int(length) > self.max_request_bytes
            except ValueError:
                return error_response(400, "Content-Length is not an integer")
            if too_big:
                return error_response(
                    413, f"request body exceeds the {self.max_request_bytes}-byte limit; send smaller requests"
                )
        return None
