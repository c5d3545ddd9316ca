"""The futures store: ``request_id`` -> pending, done or failed, waited on by long polls.

The engine worker thread completes futures; HTTP handlers on the server's event loop wait for
them. Finished results are kept for ``retention_s`` (>= 300 s) because a client whose poll is
retried and answered 404 gives up for good.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

State = Literal["pending", "done", "failed"]
MIN_RETENTION_S = 300.0


@dataclass
class Payload:
    """A finished result as it goes on the wire: protobuf bytes, or a JSON-ready dict."""

    json_body: dict[str, Any] | None = None
    proto_body: bytes | None = None


@dataclass
class FutureEntry:
    request_id: str
    kind: str
    created_at: float
    state: State = "pending"
    payload: Payload | None = None
    error: str | None = None
    category: str = "server"
    finished_at: float | None = None
    _waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = field(default_factory=list)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class FutureStore:
    """Thread-safe store of request futures with async long-poll waiting."""

    def __init__(self, retention_s: float = 900.0) -> None:
        if retention_s < MIN_RETENTION_S:
            raise ValueError(
                f"retention_s={retention_s} is too short: keep finished results at least "
                f"{MIN_RETENTION_S:.0f} s, or clients whose polls are retried fail with 404"
            )
        self._retention_s = retention_s
        self._lock = threading.Lock()
        self._entries: dict[str, FutureEntry] = {}
        self._last_eviction = time.monotonic()

    def create(self, kind: str) -> str:
        request_id = f"req-{uuid.uuid4().hex}"
        with self._lock:
            self._entries[request_id] = FutureEntry(request_id, kind, time.monotonic())
            self._evict_expired_locked()
        return request_id

    def get(self, request_id: str) -> FutureEntry | None:
        with self._lock:
            return self._entries.get(request_id)

    def complete(self, request_id: str, payload: Payload) -> None:
        self._finish(request_id, "done", payload=payload)

    def fail(self, request_id: str, error: str, category: str) -> None:
        self._finish(request_id, "failed", error=error, category=category)

    def _finish(
        self,
        request_id: str,
        state: State,
        *,
        payload: Payload | None = None,
        error: str | None = None,
        category: str = "server",
    ) -> None:
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.state != "pending":
                return
            entry.state, entry.payload, entry.error, entry.category = state, payload, error, category
            entry.finished_at = time.monotonic()
            waiters, entry._waiters = entry._waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # that waiter's loop is closed: nobody is listening any more
                pass

    async def wait(self, request_id: str, timeout_s: float) -> FutureEntry | None:
        """The entry once finished, or still pending after ``timeout_s``; None when unknown."""
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.state != "pending":
                return entry
            waiter: asyncio.Future[None] = loop.create_future()
            entry._waiters.append((loop, waiter))
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._lock:
                if (loop, waiter) in entry._waiters:
                    entry._waiters.remove((loop, waiter))
        return entry

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _evict_expired_locked(self) -> None:
        now = time.monotonic()
        if now - self._last_eviction < 10.0:
            return
        self._last_eviction = now
        expired = [
            request_id
            for request_id, entry in self._entries.items()
            if entry.finished_at is not None and now - entry.finished_at > self._retention_s
        ]
        for request_id in expired:
            del self._entries[request_id]
