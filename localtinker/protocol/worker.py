"""The one engine worker thread: model ops strictly in per-model ``seq_id`` order, sampling in steps.

Every engine call happens on this thread, so the engine needs no locking and one client's
request can never interleave with another's half-applied state. Three queues feed it:

- control jobs (create model, create sampler, listings): run first, in arrival order;
- per-model queues keyed by ``seq_id``: a model's op runs only when every lower seq_id has run.
  The SDK sends the chunks of one ``forward_backward`` in parallel with the first chunk last,
  so a later chunk simply waits here for the first;
- sample requests: handed to the engine's sample stream (continuous batching), which runs one
  decode step per turn; requests arriving mid-decode join at the next step.

Turns go to the ready consumer (each training model, and sampling as a whole) that has used the
least engine time (``fair_share.py``): a flood of samples cannot starve a training step, nor the
reverse. An idle stream waits for a burst of requests to end before it starts, so that the burst
prefills together: until none has arrived for ``sample_burst_gap_s``, at most ``sample_linger_max_s``
after the first. A lone request waits only ``sample_linger_s`` unless the stream has seen bursts: its
last idle start took two or more requests, or requests joined it within ``sample_linger_max_s``. So a
client that samples one request at a time (nothing arrives while its request runs) is not held back,
and an RL loop, whose requests arrive tens of milliseconds apart, is admitted in one prefill from its
second step on, where a fixed short linger split it into two prefills (bench/bench_rl_step.py;
docs/engine-notes.md, sampling).

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
from localtinker.protocol.fair_share import FairShare

logger = logging.getLogger("localtinker.protocol")

Done = Callable[[Any], None]
Failed = Callable[[BaseException], None]


@dataclass
class Job:
    describe: str
    run: Callable[[Engine], Any]
    on_done: Done
    on_error: Failed


@dataclass(eq=False)
class SampleJob:
    sampler_id: str
    spec: SampleSpec
    on_done: Callable[[SampleResult], None]
    on_error: Failed
    queued_at: float = field(default_factory=time.monotonic)
    # Streaming: called after each step that added tokens, with every sample's tokens so far.
    on_progress: Callable[[list[list[int]]], None] | None = None


_SKIPPED = object()  # a seq_id slot whose request was refused before queueing


@dataclass
class _ModelQueue:
    next_seq: int = 1
    waiting: dict[int, Any] = field(default_factory=dict)  # seq_id -> Job | _SKIPPED
    request_ids: dict[int, str] = field(default_factory=dict)  # seq_id -> request_id (dedupe)
    gap_since: float | None = None


class SequenceError(Exception):
    """A seq_id that arrived after later ones already ran."""


class _WholeBatchStream:
    """The sample stream of an engine that only runs whole batches (``sample_batch``): one step runs all."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._queued: list[tuple[Any, str, SampleSpec]] = []

    @property
    def busy(self) -> bool:
        return bool(self._queued)

    def submit(self, key: Any, sampler_id: str, spec: SampleSpec) -> None:
        self._queued.append((key, sampler_id, spec))

    def step(self) -> list[tuple[Any, SampleResult | BaseException]]:
        batch, self._queued = self._queued, []
        results = self.engine.sample_batch([(sampler_id, spec) for _, sampler_id, spec in batch])
        if len(results) != len(batch):
            raise RuntimeError(f"engine.sample_batch returned {len(results)} results for {len(batch)} requests")
        return [(key, result) for (key, _, _), result in zip(batch, results)]


def _new_stream(engine: Engine):
    """The engine's continuous-batching stream, or whole batches for engines without one (test fakes)."""
    return engine.sample_stream() if hasattr(engine, "sample_stream") else _WholeBatchStream(engine)


_SAMPLING = "sampling"  # the fair-share consumer that sampling as a whole is


class EngineWorker:
    def __init__(
        self,
        engine: Engine,
        *,
        gap_timeout_s: float = 60.0,
        sample_linger_s: float = 0.005,
        sample_burst_gap_s: float = 0.03,
        sample_linger_max_s: float = 0.2,
    ) -> None:
        self.engine = engine
        self._gap_timeout_s = gap_timeout_s
        self._sample_linger_s = sample_linger_s
        self._sample_burst_gap_s = sample_burst_gap_s
        self._sample_linger_max_s = sample_linger_max_s
        self._idle_start = float("-inf")  # when the stream last started from idle (worker thread)
        self._bursty = False  # that start took several requests, or requests joined it soon after
        self._cond = threading.Condition()
        self._control: deque[Job] = deque()
        self._models: dict[str, _ModelQueue] = {}
        self._model_order: deque[str] = deque()
        self._samples: list[SampleJob] = []  # arrived, not yet handed to the stream
        self._stream = _new_stream(engine)
        self._in_stream: set[SampleJob] = set()  # touched by the worker thread only
        self._fair = FairShare()
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

    def forget_model(self, model_id: str, why: str | None = None) -> None:
        """Drops ``model_id``'s queue; its queued requests fail with ``why`` (default: it was not created)."""
        with self._cond:
            queue = self._models.pop(model_id, None)
            if model_id in self._model_order:
                self._model_order.remove(model_id)
            self._fair.forget(model_id)
        message = why or f"model {model_id} was not created; its queued requests are dropped"
        for job in (queue.waiting.values() if queue else ()):
            if isinstance(job, Job):
                _safely(job.on_error, EngineUserError(message))

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

    @property
    def sampling_stats(self) -> Any:
        """The sample stream's counters (``SamplingStats``: prefilled and reused prompt tokens, decode steps,
        preemptions ...), or None for an engine without a stream. Read-only; for benchmarks and diagnostics."""
        return getattr(self._stream, "stats", None)

    def queue_depth(self) -> dict[str, int]:
        with self._cond:
            return {
                "control": len(self._control),
                "model_ops": sum(len(q.waiting) for q in self._models.values()),
                "samples": len(self._samples) + len(self._in_stream),
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
            consumer, job = work
            started = time.monotonic()
            if job is None:
                self._run_sampling_step()
            else:
                self._run_job(job)
            with self._cond:
                self._fair.charge(consumer, time.monotonic() - started)
        for on_error in abandoned:
            _safely(on_error, RuntimeError("localtinker is shutting down; the request was not run"))

    def _drain_locked(self) -> list[Failed]:
        jobs = [*self._samples, *self._in_stream]
        abandoned = [job.on_error for job in self._control] + [job.on_error for job in jobs]
        for queue in self._models.values():
            abandoned += [job.on_error for job in queue.waiting.values() if isinstance(job, Job)]
            queue.waiting.clear()
        self._control.clear()
        self._samples = []
        self._in_stream.clear()
        return abandoned

    def _wait_timeout_locked(self) -> float:
        if self._samples:
            return max(0.0005, self._linger_left_locked())
        stalled = any(q.waiting for q in self._models.values())
        return 1.0 if stalled else 5.0

    def _next_work_locked(self) -> tuple[str, Job | None] | None:
        """(consumer, job) to run next; job None means a sampling step. Control jobs go first, uncharged."""
        if self._control:
            return "control", self._control.popleft()
        ready = [model_id for model_id in self._model_order if self._model_ready_locked(model_id)]
        if self._sampling_ready_locked():
            ready.append(_SAMPLING)
        if not ready:
            return None
        chosen = self._fair.pick(ready)
        if chosen == _SAMPLING:
            return _SAMPLING, None
        self._model_order.remove(chosen)  # round-robin among equals: the model just served goes last
        self._model_order.append(chosen)
        return chosen, self._pop_ready_locked(chosen, self._models[chosen])

    def _sampling_ready_locked(self) -> bool:
        """A step is due while the stream has work; an idle stream first lingers so a burst batches together."""
        if self._in_stream or self._stream.busy:
            return True
        return bool(self._samples) and self._linger_left_locked() <= 0

    def _linger_left_locked(self) -> float:
        """Seconds until an idle stream starts on the queued requests: a lone request's linger, or for a
        burst a quiet gap after the latest arrival, capped by the longest wait of the first."""
        first = self._samples[0].queued_at
        if len(self._samples) == 1 and not self._bursty:
            return first + self._sample_linger_s - time.monotonic()
        quiet = self._samples[-1].queued_at + self._sample_burst_gap_s
        return min(quiet, first + self._sample_linger_max_s) - time.monotonic()

    def _model_ready_locked(self, model_id: str) -> bool:
        queue = self._models[model_id]
        self._skip_refused_locked(model_id, queue)
        return queue.next_seq in queue.waiting

    def _pop_ready_locked(self, model_id: str, queue: _ModelQueue) -> Job:
        job = queue.waiting.pop(queue.next_seq)
        queue.next_seq += 1
        return job

    def _skip_refused_locked(self, model_id: str, queue: _ModelQueue) -> None:
        """Moves ``next_seq`` past refused seq_ids, and past a missing one after ``gap_timeout_s``."""
        while queue.waiting:
            if queue.next_seq in queue.waiting:
                queue.gap_since = None
                if queue.waiting[queue.next_seq] is not _SKIPPED:
                    return
                del queue.waiting[queue.next_seq]
                queue.next_seq += 1
                continue
            now = time.monotonic()
            if queue.gap_since is None:
                queue.gap_since = now
            if now - queue.gap_since < self._gap_timeout_s:
                return
            lowest = min(queue.waiting)
            logger.warning(
                "model %s: seq_id %d never arrived within %.0f s; skipping to seq_id %d",
                model_id, queue.next_seq, self._gap_timeout_s, lowest,
            )
            queue.next_seq, queue.gap_since = lowest, None

    def _run_job(self, job: Job) -> None:
        try:
            result = job.run(self.engine)
        except BaseException as e:  # noqa: BLE001 - every failure goes back to its own request
            if not isinstance(e, EngineUserError):
                logger.exception("engine error in %s", job.describe)
            _safely(job.on_error, e)
            return
        _safely(job.on_done, result)

    def _note_burst(self, arrived: list[SampleJob]) -> None:
        """Whether the stream sees bursts: its idle start took several requests, or requests joined the
        batch that start began within ``sample_linger_max_s``."""
        if not arrived:
            return
        now = time.monotonic()
        if not (self._in_stream or self._stream.busy):
            self._idle_start, self._bursty = now, len(arrived) > 1
        elif now - self._idle_start <= self._sample_linger_max_s:
            self._bursty = True

    def _run_sampling_step(self) -> None:
        """Hands newly arrived requests to the stream, runs one step, completes the requests it finished."""
        with self._cond:
            arrived, self._samples = self._samples, []
        self._note_burst(arrived)
        try:
            for job in arrived:
                self._in_stream.add(job)
                self._stream.submit(job, job.sampler_id, job.spec)
            completed = self._stream.step()
        except BaseException as e:  # noqa: BLE001 - a broken step fails the requests in it, not the worker
            if not isinstance(e, EngineUserError):
                logger.exception("engine error in a sampling step of %d requests", len(self._in_stream))
            failed, self._in_stream = self._in_stream, set()
            self._stream = _new_stream(self.engine)
            for job in failed:
                _safely(job.on_error, e)
            return
        finished = {job for job, _ in completed}
        self._report_progress([job for job in self._in_stream if job.on_progress is not None and job not in finished])
        for job, result in completed:
            self._in_stream.discard(job)
            if isinstance(result, BaseException):
                _safely(job.on_error, result)
            else:
                _safely(job.on_done, result)


    def _report_progress(self, streaming: list[SampleJob]) -> None:
        progress = getattr(self._stream, "progress", None)  # engines without a stream report at the end only
        if progress is None:
            return
        for job in streaming:
            tokens = progress(job)
            if tokens is not None:
                _safely(job.on_progress, tokens)


def _safely(callback: Callable[[Any], None], value: Any) -> None:
    """A failing completion callback must not take the worker thread (and every client) down."""
    try:
        callback(value)
    except Exception:  # noqa: BLE001
        logger.exception("completion callback failed")
