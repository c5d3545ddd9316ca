"""Signed download URLs served by localtinker itself (external weights, session traces).

The SDK fetches such URLs with a plain GET and no API key, as it would a presigned object-store URL. Each
grant is an unguessable token naming the files it may fetch and when it expires; the server checks both on
every GET. Grants live in memory: after a restart the URL answers 403 and the client asks for a fresh one.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import ProtocolError, not_found

DOWNLOADS = "/downloads"  # outside /api/v1: the guard lets these through without an API key


@dataclass(frozen=True)
class _Grant:
    what: str
    files: dict[str, Path]
    expires_at: float


class SignedDownloads:
    """token -> the files it may fetch until when; thread-safe, pruned as it grows."""

    def __init__(self) -> None:
        self._grants: dict[str, _Grant] = {}
        self._lock = threading.Lock()

    def grant(self, what: str, files: dict[str, Path], expires_at: float) -> str:
        """A token for ``files`` (name -> path) until ``expires_at``; ``what`` names them in errors."""
        token = secrets.token_urlsafe(32)
        now = time.time()
        with self._lock:
            for old in [t for t, g in self._grants.items() if g.expires_at <= now]:
                del self._grants[old]
            self._grants[token] = _Grant(what, dict(files), expires_at)
        return token

    def file(self, token: str, name: str) -> Path:
        with self._lock:
            grant = self._grants.get(token)
        if grant is None or name not in grant.files:
            raise ProtocolError(
                403, "this download URL is not valid (wrong, or signed by an earlier server run); "
                "ask the server for fresh ones (get_external_weights_urls, export_session_trace)"
            )
        if grant.expires_at <= time.time():
            raise ProtocolError(
                403, f"this download URL expired at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(grant.expires_at))}; ask "
                "the server for fresh ones (get_external_weights_urls, export_session_trace)"
            )
        path = grant.files[name]
        if not path.is_file():
            raise not_found(f"{grant.what} was deleted (or expired) after this URL was signed")
        return path


