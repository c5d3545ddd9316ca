"""Errors the protocol layer answers with an HTTP status instead of a queued future."""

from __future__ import annotations


class ProtocolError(Exception):
    """A request the server refuses before queueing it; ``status`` is the HTTP code to answer.

    The message is sent to the client verbatim, so it names the field, what is wrong and the fix.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def bad_request(message: str) -> ProtocolError:
    return ProtocolError(400, message)


def not_found(message: str) -> ProtocolError:
    return ProtocolError(404, message)


class OversizedBody(ProtocolError):
    """A 413 for a body over the limit; ``head`` is what was read before refusing (at most one chunk over)."""

    def __init__(self, limit: int, head: bytes) -> None:
        super().__init__(413, f"request body exceeds the {limit}-byte limit; send smaller requests")
        self.head = head
