"""The HTTP face of localtinker: tinker SDK 0.38 wire protocol -> engine calls on the worker thread.

Handlers only decode, validate, queue and encode; they live in ``routes/``, one module per route family,
over the shared ``ServiceCore``. Model ops (F endpoints) answer ``{request_id, model_id?}`` at once; the
result is fetched through ``retrieve_future``, which long-polls and answers HTTP 408 while the request is
still pending (the SDK retries 408 quietly).
"""

from __future__ import annotations

from pathlib import Path

from starlette.applications import Starlette
from starlette.types import ASGIApp

from localtinker.engine.api import Engine

from .core import ProtocolConfig, ServiceCore
from .guard import GuardMiddleware
from .routes.checkpoints import CheckpointRoutes
from .routes.futures import FutureRoutes
from .routes.openai import OpenAIRoutes
from .routes.sampling import SamplingRoutes
from .routes.session_info import SessionInfoRoutes
from .routes.sessions import SessionRoutes
from .routes.training import TrainingRoutes
from .routes.weights import WeightsRoutes

__all__ = ["LocalTinkerService", "ProtocolConfig"]


class LocalTinkerService(ServiceCore):
    """The service: the shared core plus every route family, served behind the guard middleware."""

    def __init__(self, engine: Engine, storage_dir: Path | None, config: ProtocolConfig = ProtocolConfig()) -> None:
        super().__init__(engine, storage_dir, config)
        self.families = (
            SessionRoutes(self),
            SessionInfoRoutes(self),
            TrainingRoutes(self),
            SamplingRoutes(self),
            FutureRoutes(self),
            CheckpointRoutes(self),
            WeightsRoutes(self),
            OpenAIRoutes(self),
        )

    def build_app(self) -> ASGIApp:
        routes = [r for family in self.families for r in family.routes()]
        app = Starlette(routes=routes, exception_handlers={404: self.unrouted, 405: self.unrouted})
        return GuardMiddleware(app, api_key=self.config.api_key, max_request_bytes=self.config.max_request_bytes)
