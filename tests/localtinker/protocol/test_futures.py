"""The futures store: long-poll waits wake on completion, time out while pending, keep results."""

from __future__ import annotations

import asyncio
import threading

import pytest

from localtinker.protocol.futures import FutureStore, Payload


def test_wait_wakes_when_another_thread_completes_the_future() -> None:
    store = FutureStore()
    request_id = store.create("forward_backward")

    async def poll():
        threading.Timer(0.05, store.complete, args=(request_id, Payload(json_body={"ok": 1}))).start()
        return await store.wait(request_id, timeout_s=5.0)

    entry = asyncio.run(poll())
    assert entry is not None and entry.state == "done" and entry.payload.json_body == {"ok": 1}


def test_wait_returns_the_pending_entry_after_the_timeout() -> None:
    store = FutureStore()
    request_id = store.create("sample")
    entry = asyncio.run(store.wait(request_id, timeout_s=0.05))
    assert entry is not None and entry.state == "pending"
    assert asyncio.run(store.wait("req-unknown", timeout_s=0.01)) is None


def test_failure_keeps_message_and_category_and_is_final() -> None:
    store = FutureStore()
    request_id = store.create("optim_step")
    store.fail(request_id, "bad AdamParams", "user")
    store.complete(request_id, Payload(json_body={}))  # a late completion does not overwrite the failure
    entry = store.get(request_id)
    assert (entry.state, entry.error, entry.category) == ("failed", "bad AdamParams", "user")


def test_results_must_be_kept_at_least_300_seconds() -> None:
    with pytest.raises(ValueError, match="at least 300"):
        FutureStore(retention_s=60)
