"""Weights for download: signed per-file URLs for external-weights checkpoints, and the files behind them.

The SDK (``RestClient.get_external_weights_urls``, ``tinker checkpoint download``) fetches each URL with a
plain GET and no API key; each signing is a grant of ``downloads.SignedDownloads`` that expires after
``download_url_ttl_s``, never after the checkpoint itself.
"""

from __future__ import annotations

import time
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from localtinker.engine.api import CheckpointFiles

from ..core import ServiceCore, iso
from ..downloads import DOWNLOADS


class WeightsRoutes:
    def __init__(self, core: ServiceCore) -> None:
        self.core = core

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
        token = self.core.downloads.grant(path, found.files, expires_at)
        base = str(request.base_url).rstrip("/")
        urls = {name: f"{base}{DOWNLOADS}/{token}/{quote(name)}" for name in found.files}
        return JSONResponse({"urls": urls, "expires": iso(expires_at)})

    async def download(self, request: Request) -> Response:
        path = self.core.downloads.file(request.path_params["token"], request.path_params["name"])
        return FileResponse(path, media_type="application/octet-stream")
