"""Weights for download: signed per-file URLs for external-weights checkpoints, and the files behind them.

The SDK (``RestClient.get_external_weights_urls``, ``tinker checkpoint download``) fetches each URL with a
plain GET and no API key, as it would a presigned object-store URL. So each signing mints an unguessable
token that names the checkpoint's files and expires (at most ``download_url_ttl_s``, never after the
checkpoint itself); the server checks both on every GET. Tokens live in memory: a restarted server
answers 403 and the client signs again.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from localtinker.engine.api import CheckpointFiles

from ..core import ServiceCore, iso
from ..errors import ProtocolError, not_found

DOWNLOADS = "/downloads"  # outside /api/v1: the guard lets these through without an API key


@dataclass(frozen=True)
class _Grant:
    tinker_path: str
    files: dict[str, Path]
    expires_at: float


class SignedDownloads:
    """token -> the files it may fetch until when; thread-safe, pruned as it grows."""

    def __init__(self) -> None:
        self._grants: dict[str, _Grant] = {}
        self._lock = threading.Lock()

    def grant(self, tinker_path: str, files: dict[str, Path], expires_at: float) -> str:
        token = secrets.token_urlsafe(32)
        now = time.time()
        with self._lock:
            for old in [t for t, g in self._grants.items() if g.expires_at <= now]:
                del self._grants[old]
            self._grants[token] = _Grant(tinker_path, dict(files), expires_at)
        return token

    def file(self, token: str, name: str) -> Path:
        with self._lock:
            grant = self._grants.get(token)
        if grant is None or name not in grant.files:
            raise ProtocolError(
                403, "this download URL is not valid (wrong, or signed by an earlier server run); "
                "ask RestClient.get_external_weights_urls for fresh ones"
            )
        if grant.expires_at <= time.time():
            raise ProtocolError(
                403, f"this download URL expired at {iso(grant.expires_at)}; ask "
                "RestClient.get_external_weights_urls for fresh ones"
            )
        path = grant.files[name]
        if not path.is_file():
            raise not_found(f"{grant.tinker_path} was deleted (or expired) after this URL was signed")
        return path


class WeightsRoutes:
    def __init__(self, core: ServiceCore) -> None:
        self.core = core
        self.downloads = SignedDownloads()

    def routes(self) -> list[Route]:
        return [
            self.core.route(
                "training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls",
                self.external_weights_urls,
                "GET",
            ),
            Route(f"{DOWNLOADS}/{{token}}/{{name}}", self.core.endpoint(self.download), methods=["GET"]),
        ]

    async def external_weights_urls(self, request: Request) -> Response:
        path = f"tinker://{request.path_params['run_id']}/{request.path_params['checkpoint_id']}"
        found: CheckpointFiles = await self.core.on_worker(
            f"external_weights_urls {path}", lambda e: e.external_weights_files(path)
        )
        expires_at = time.time() + self.core.config.download_url_ttl_s
        if found.expires_at is not None:
            expires_at = min(expires_at, found.expires_at)
        token = self.downloads.grant(path, found.files, expires_at)
        base = str(request.base_url).rstrip("/")
        urls = {name: f"{base}{DOWNLOADS}/{token}/{quote(name)}" for name in found.files}
        return JSONResponse({"urls": urls, "expires": iso(expires_at)})

    async def download(self, request: Request) -> Response:
        path = self.downloads.file(request.path_params["token"], request.path_params["name"])
        return FileResponse(path, media_type="application/octet-stream")
