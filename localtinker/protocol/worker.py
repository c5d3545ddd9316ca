"""The one engine worker thread: model ops strictly in per-model ``seq_id`` order, samples batched.

Every engine call happens on this thread, so the engine needs no locking and one client's
request can never interleave with another's half-applied state. Three queues feed it:

- control jobs (create model, create sampler, listings): run first, in arrival order;
- per-model queues keyed by ``seq_id``: a model's op runs only when every lower seq_id has run.
  The SDK sends the chunks of one ``forward_backward`` in parallel with the first chunk last,
  so a later chunk simply waits here for the first;
- sample requests: everything queued is drained into one ``engine.sample_batch`` call.

A seq_id that never arrives (its request was refused before queueing without the protocol
knowing its number) would stall the model forever; after ``gap_timeout_s`` the worker skips it
and logs a warning.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from localtinker.engine.api import Engine, EngineUserError, SampleResult, SampleSpec

logger = logging.getLogger("localtinker.protocol")

Done = Callable[[Any], None]
Failed = Callable[[BaseException], None]


@dataclass
class Job:
    describe: str
    run: Callable[[Engine], Any]
    on_done: Done
    on_error: Failed


@dataclass
class SampleJob:
    sampler_id: str
    spec: SampleSpec
    on_done: Callable[[SampleResult], None]
    on_error: Failed
    queued_at: float = field(default_factory=time.monotonic)


_SKIPPED = object()  # a seq_id slot whose request was refused before queueing


@dataclass
class _ModelQueue:
    next_seq: int = 1
    waiting: dict[int, Any] = field(default_factory=dict)  # seq_id -> Job | _SKIPPED
    request_ids: dict[int, str] = field(default_factory=dict)  # seq_id -> request_id (dedupe)
    gap_since: float | None = None


class SequenceError(Exception):
    """A seq_id that arrived after later ones already ran."""


class EngineWorker:
    def __init__(self, engine: Engine, *, gap_timeout_s: float = 60.0, sample_linger_s: float = 0.005) -> None:
        self.engine = engine
        self._gap_timeout_s = gap_timeout_s
        self._sample_linger_s = sample_linger_s
        self._cond = threading.Condition()
        self._control: deque[Job] = deque()
        self._models: dict[str, _ModelQueue] = {}
        self._model_order: deque[str] = deque()
        self._samples: list[SampleJob] = []
        self._prefer_samples = False
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="localtinker-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    # ---- submission (any thread) -------------------------------------------------------------

    def submit_control(self, job: Job) -> None:
        with self._cond:
            self._control.append(job)
            self._cond.notify_all()

    def call(self, describe: str, run: Callable[[Engine], Any]) -> Future[Any]:
        """Runs ``run(engine)`` on the worker; the returned future carries its result."""
        future: Future[Any] = Future()
        self.submit_control(Job(describe, run, future.set_result, future.set_exception))
        return future

    def register_model(self, model_id: str) -> None:
        with self._cond:
            if model_id not in self._models:
                self._models[model_id] = _ModelQueue()
                self._model_order.append(model_id)

    def has_model(self, model_id: str) -> bool:
        with self._cond:
            return model_id in self._models

    def forget_model(self, model_id: str) -> None:
        with self._cond:
            queue = self._models.pop(model_id, None)
            if model_id in self._model_order:
                self._model_order.remove(model_id)
        for job in (queue.waiting.values() if queue else ()):
            if isinstance(job, Job):
                _safely(job.on_error, EngineUserError(f"model {model_id} was not created; its queued requests are dropped"))

    def submitted_request(self, model_id: str, seq_id: int | None) -> str | None:
        """The request id already given to ``(model_id, seq_id)``: a retried submission is not run twice."""
        if seq_id is None:
            return None
        with self._cond:
            queue = self._models.get(model_id)
            return queue.request_ids.get(seq_id) if queue else None

    def submit_model_op(self, model_id: str, seq_id: int | None, request_id: str, job: Job) -> None:
        """Queues ``job`` at ``seq_id`` (None: after everything queued). Raises KeyError for an unknown model."""
        with self._cond:
            queue = self._models[model_id]
            seq = seq_id if seq_id is not None else max([queue.next_seq - 1, *queue.waiting]) + 1
            if seq < queue.next_seq or seq in queue.waiting:
                raise SequenceError(
                    f"seq_id {seq} of model {model_id} arrived after seq_id {queue.next_seq - 1} already "
                    "ran (or twice with different requests); requests of one training client must be "
                    "sent with increasing seq_ids"
                )
            queue.waiting[seq] = job
            queue.request_ids[seq] = request_id
            self._prune_request_ids(queue)
            self._cond.notify_all()

    def skip_model_seq(self, model_id: str, seq_id: int | None) -> None:
        """Marks a seq_id whose request was refused, so the model's later requests still run."""
        if seq_id is None:
            return
        with self._cond:
            queue = self._models.get(model_id)
            if queue is not None and seq_id >= queue.next_seq and seq_id not in queue.waiting:
                queue.waiting[seq_id] = _SKIPPED
                self._cond.notify_all()

    def submit_sample(self, job: SampleJob) -> None:
        with self._cond:
            self._samples.append(job)
            self._cond.notify_all()

    def queue_depth(self) -> dict[str, int]:
        with self._cond:
            return {
                "control": len(self._control),
                "model_ops": sum(len(q.waiting) for q in self._models.values()),
                "samples": len(self._samples),
            }

    @staticmethod
    def _prune_request_ids(queue: _ModelQueue) -> None:
        if len(queue.request_ids) > 4096:
            horizon = queue.next_seq - 2048
            for seq in [s for s in queue.request_ids if s < horizon]:
                del queue.request_ids[seq]

    # ---- the worker thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                work = None if self._stopping else self._next_work_locked()
                while work is None and not self._stopping:
                    self._cond.wait(timeout=self._wait_timeout_locked())
                    work = None if self._stopping else self._next_work_locked()
                if self._stopping:
                    abandoned = self._drain_locked()
                    break
            if isinstance(work, Job):
                self._run_job(work)
            else:
                self._run_samples(work)
        for on_error in abandoned:
            _safely(on_error, RuntimeError("localtinker is shutting down; the request was not run"))

    def _drain_locked(self) -> list[Failed]:
        abandoned = [job.on_error for job in self._control] + [job.on_error for job in self._samples]
        for queue in self._models.values():
            abandoned += [job.on_error for job in queue.waiting.values() if isinstance(job, Job)]
            queue.waiting.clear()
        self._control.clear()
        self._samples = []
        return abandoned

    def _wait_timeout_locked(self) -> float:
        if self._samples:
            return max(0.0005, self._sample_linger_s)
        stalled = any(q.waiting for q in self._models.values())
        return 1.0 if stalled else 5.0

    def _next_work_locked(self) -> Job | list[SampleJob] | None:
        if self._control:
            return self._control.popleft()
        model_job = None
        if not (self._prefer_samples and self._samples):
            model_job = self._next_model_job_locked()
        if model_job is not None:
            self._prefer_samples = True
            return model_job
        if self._samples and self._samples_ready_locked():
            batch, self._samples = self._samples, []
            self._prefer_samples = False
            return batch
        return None

    def _samples_ready_locked(self) -> bool:
        """Lingers a few ms after the first sample arrives so concurrent requests batch together."""
        waited = time.monotonic() - self._samples[0].queued_at
        return waited >= self._sample_linger_s or self._stopping

    def _next_model_job_locked(self) -> Job | None:
        for _ in range(len(self._model_order)):
            model_id = self._model_order[0]
            self._model_order.rotate(-1)
            queue = self._models[model_id]
            job = self._pop_ready_locked(model_id, queue)
            if job is not None:
                return job
        return None

    def _pop_ready_locked(self, model_id: str, queue: _ModelQueue) -> Job | None:
        while queue.waiting:
            if queue.next_seq in queue.waiting:
                queue.gap_since = None
                job = queue.waiting.pop(queue.next_seq)
                queue.next_seq += 1
                if job is _SKIPPED:
                    continue
                return job
            now = time.monotonic()
            if queue.gap_since is None:
                queue.gap_since = now
            if now - queue.gap_since < self._gap_timeout_s:
                return None
            lowest = min(queue.waiting)
            logger.warning(
                "model %s: seq_id %d never arrived within %.0f s; skipping to seq_id %d",
                model_id, queue.next_seq, self._gap_timeout_s, lowest,
            )
            queue.next_seq, queue.gap_since = lowest, None
        return None

    def _run_job(self, job: Job) -> None:
        try:
            result = job.run(self.engine)
        except BaseException as e:  # noqa: BLE001 - every failure goes back to its own request
            if not isinstance(e, EngineUserError):
                logger.exception("engine error in %s", job.describe)
            _safely(job.on_error, e)
            return
        _safely(job.on_done, result)

    def _run_samples(self, batch: list[SampleJob]) -> None:
        try:
            results = self.engine.sample_batch([(job.sampler_id, job.spec) for job in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"engine.sample_batch returned {len(results)} results for {len(batch)} requests")
        except BaseException as e:  # noqa: BLE001
            if not isinstance(e, EngineUserError):
                logger.exception("engine error in sample_batch of %d requests", len(batch))
            for job in batch:
                _safely(job.on_error, e)
            return
        for job, result in zip(batch, results):
            if isinstance(result, BaseException):
                _safely(job.on_error, result)
            else:
                _safely(job.on_done, result)


def _safely(callback: Callable[[Any], None], value: Any) -> None:
    """A failing completion callback must not take the worker thread (and every client) down."""
    try:
        callback(value)
    except Exception:  # noqa: BLE001
        logger.exception("completion callback failed")
