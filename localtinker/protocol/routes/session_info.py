"""The RestClient's session queries: get_session, list_sessions, search_sessions and export_session_trace.

Local semantics: one user ("local") and one project ("local"); sessions live as long as the server process
(training runs and checkpoints outlive it). A session's trace is the timeline of its training and sampling
requests in the Chrome trace-event JSON format, which https://ui.perfetto.dev opens like a .pftrace file.
"""

from __future__ import annotations

import datetime as dt
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localtinker.engine.api import CheckpointInfo

from ..core import ServiceCore, iso, page
from ..downloads import DOWNLOADS
from ..errors import ProtocolError, bad_request, not_found
from ..registry import SessionRecord

LOCAL_OWNER = "local"
LOCAL_PROJECT = "local"


def _status(session: SessionRecord) -> dict[str, Any]:
    if session.finished is None:
        return {"type": "active"}
    return {"type": "client_finished", "reason": {"type": session.finished}}


def _matches_status(session: SessionRecord, queries: list[dict[str, Any]] | None) -> bool:
    if not queries:
        return True
    status = _status(session)
    for query in queries:
        if query.get("type") != status["type"]:
            continue
        reasons = query.get("reasons")
        if status["type"] != "client_finished" or not reasons or status["reason"]["type"] in reasons:
            return True
    return False


def _matches_name(session: SessionRecord, session_id: str | None, display_name: str | None) -> bool:
    if session_id is None and display_name is None:
        return True
    if session_id is not None and session.session_id == session_id:
        return True
    if display_name is not None and session.display_name:
        name = session.display_name.lower()
        return all(word in name for word in display_name.lower().split())
    return False


def trace_events(session: SessionRecord) -> dict[str, Any]:
    """Chrome trace-event JSON: one track per model or sampler, one complete ("X") event per request."""
    tracks: dict[str, int] = {}
    events: list[dict[str, Any]] = []
    for event in session.events:
        tid = tracks.setdefault(event.track, len(tracks) + 1)
        events.append(
            {
                "name": event.name,
                "cat": "sample" if event.name == "sample" else "training",
                "ph": "X",
                "ts": round(event.start * 1e6),
                "dur": max(1, round((event.end - event.start) * 1e6)),
                "pid": 1,
                "tid": tid,
                "args": {"ok": event.ok},
            }
        )
    names = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": track}} for track, tid in tracks.items()]
    process = {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": f"session {session.session_id}"}}
    return {"traceEvents": [process, *names, *events], "displayTimeUnit": "ms"}


class SessionInfoRoutes:
    def __init__(self, core: ServiceCore) -> None:
        self.core = core
        storage = core.storage_dir
        self._trace_dir = Path(storage) / "protocol" / "traces" if storage else Path(tempfile.mkdtemp(prefix="lt-traces-"))

    def routes(self) -> list[Route]:
        return [
            self.core.route("sessions", self.list_sessions, "GET"),
            self.core.route("sessions/search", self.search_sessions, "POST"),
            self.core.route("sessions/{session_id}", self.get_session, "GET"),
            self.core.route("sessions/{session_id}/trace_export", self.trace_export, "GET"),
        ]

    def _session(self, request: Request) -> SessionRecord:
        session_id = request.path_params["session_id"]
        session = self.core.registry.session(session_id)
        if session is None:
            raise not_found(
                f"unknown session {session_id!r}; sessions live as long as the server process "
                "(RestClient.list_sessions shows this run's)"
            )
        return session

    async def get_session(self, request: Request) -> Response:
        session = self._session(request)
        registry = self.core.registry
        return JSONResponse(
            {
                "training_run_ids": registry.session_runs(session.session_id),
                "sampler_ids": registry.session_samplers(session.session_id),
                "user_metadata": session.user_metadata or None,
                "display_name": session.display_name,
            }
        )

    async def list_sessions(self, request: Request) -> Response:
        limit, offset = page(request, default_limit=20)
        sessions = self.core.registry.all_sessions()
        return JSONResponse({"sessions": [s.session_id for s in sessions[offset : offset + limit]]})

    async def search_sessions(self, request: Request) -> Response:
        endpoint = "sessions/search"
        body = await self.core.json(request, endpoint)
        limit = body.get("limit", 50)
        if not isinstance(limit, int) or not 1 <= limit <= 200:
            raise bad_request(f"{endpoint}: limit={limit!r} must be between 1 and 200")
        projects = body.get("project_ids")
        if projects is not None and LOCAL_PROJECT not in projects:
            return JSONResponse({"sessions": [], "next_cursor": None})
        wanted_metadata = body.get("user_metadata") or {}
        matches = [
            s
            for s in self.core.registry.all_sessions()
            if _matches_name(s, body.get("session_id"), body.get("display_name"))
            and all(s.user_metadata.get(k) == v for k, v in wanted_metadata.items())
            and _matches_status(s, body.get("statuses"))
        ]
        cursor = body.get("cursor")
        if cursor:
            after = (dt.datetime.fromisoformat(cursor["last_created_at"]).timestamp(), cursor["last_session_id"])
            matches = [s for s in matches if (s.created_at, s.session_id) < after]
        page_items = matches[:limit]
        checkpoints = await self.core.on_worker("list_checkpoints", lambda e: e.list_checkpoints(None))
        summaries = [self._summary(s, checkpoints) for s in page_items]
        next_cursor = None
        if len(matches) > limit:
            last = page_items[-1]
            next_cursor = {"last_created_at": iso(last.created_at), "last_session_id": last.session_id}
        return JSONResponse({"sessions": summaries, "next_cursor": next_cursor})

    def _summary(self, session: SessionRecord, checkpoints: list[CheckpointInfo]) -> dict[str, Any]:
        mine = [c for c in checkpoints if c.run_id.startswith(f"{session.session_id}:train:")]
        return {
            "session_id": session.session_id,
            "created_at": iso(session.created_at),
            "owner": LOCAL_OWNER,
            "project_id": LOCAL_PROJECT,
            "status": _status(session),
            "checkpoints_count": len(mine),
            "display_name": session.display_name,
            "user_metadata": session.user_metadata or None,
            "checkpoint_storage_bytes": sum(c.size_bytes for c in mine),
        }

    async def trace_export(self, request: Request) -> Response:
        """Built at once (the SDK polls until ``ready``); served through a signed URL like external weights."""
        session = self._session(request)
        if session.trace_dropped:
            raise ProtocolError(
                410,
                f"the trace of session {session.session_id} was dropped: localtinker keeps the traces of the "
                f"{self.core.config.finished_traces_kept} most recently finished sessions (export a trace before "
                "that many more finish)",
            )
        self._trace_dir.mkdir(parents=True, exist_ok=True)
        target = self._trace_dir / f"{session.session_id}.json"
        staging = target.with_suffix(f".{time.monotonic_ns()}.tmp")
        staging.write_text(json.dumps(trace_events(session)))
        staging.replace(target)
        expires_at = time.time() + self.core.config.download_url_ttl_s
        name = f"{session.session_id}.json"
        token = self.core.downloads.grant(f"the trace of session {session.session_id}", {name: target}, expires_at)
        url = f"{str(request.base_url).rstrip('/')}{DOWNLOADS}/{token}/{name}"
        return JSONResponse({"status": "ready", "url": url, "error": None})
