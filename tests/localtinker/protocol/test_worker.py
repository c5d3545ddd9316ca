"""The engine worker: per-model seq_id order, duplicate/skip handling, sample batching, isolation."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from concurrent.futures import Future

import pytest

from localtinker.engine.api import EngineUserError, SampledSequence, SampleResult, SampleSpec
from localtinker.protocol.worker import EngineWorker, Job, SampleJob, SequenceError


class BatchRecorder:
    """Just enough engine for the worker: sample_batch echoes one sequence per request."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def sample_batch(self, requests):
        self.batches.append([sampler for sampler, _ in requests])
        return [SampleResult([SampledSequence([1], [-0.5], "length")]) for _ in requests]


@pytest.fixture
def worker():
    w = EngineWorker(BatchRecorder(), gap_timeout_s=0.3, sample_linger_s=0.0)
    w.start()
    yield w
    w.stop()


def _op(log: list, name: str) -> tuple[Job, Future]:
    done: Future = Future()
    return Job(name, lambda engine: log.append(name) or name, done.set_result, done.set_exception), done


def test_ops_of_one_model_run_in_seq_id_order_whatever_the_arrival_order(worker: EngineWorker) -> None:
    log: list[str] = []
    worker.register_model("m")
    jobs = {seq: _op(log, f"op{seq}") for seq in (1, 2, 3)}
    for seq in (3, 2, 1):  # the SDK sends later chunks first and the first chunk last
        worker.submit_model_op("m", seq, f"req{seq}", jobs[seq][0])
    assert [jobs[seq][1].result(timeout=5) for seq in (1, 2, 3)] == ["op1", "op2", "op3"]
    assert log == ["op1", "op2", "op3"]


def test_a_retried_submission_is_recognised_and_a_stale_seq_id_refused(worker: EngineWorker) -> None:
    log: list[str] = []
    worker.register_model("m")
    job, done = _op(log, "op1")
    worker.submit_model_op("m", 1, "req1", job)
    done.result(timeout=5)
    assert worker.submitted_request("m", 1) == "req1"
    with pytest.raises(SequenceError, match="arrived after"):
        worker.submit_model_op("m", 1, "req1-again", _op(log, "again")[0])
    assert log == ["op1"]


def test_a_refused_seq_id_is_skipped_and_a_missing_one_times_out(worker: EngineWorker) -> None:
    log: list[str] = []
    worker.register_model("m")
    worker.skip_model_seq("m", 1)
    job2, done2 = _op(log, "op2")
    worker.submit_model_op("m", 2, "req2", job2)
    assert done2.result(timeout=5) == "op2"
    job4, done4 = _op(log, "op4")  # seq 3 never arrives: the worker waits gap_timeout_s, then moves on
    worker.submit_model_op("m", 4, "req4", job4)
    assert done4.result(timeout=5) == "op4"


def test_a_failing_op_fails_only_its_own_request(worker: EngineWorker) -> None:
    worker.register_model("m")
    failed: Future = Future()

    def boom(engine):
        raise EngineUserError("token id 99999 is outside the vocab")

    worker.submit_model_op("m", 1, "req1", Job("boom", boom, failed.set_result, failed.set_exception))
    job2, done2 = _op([], "op2")
    worker.submit_model_op("m", 2, "req2", job2)
    with pytest.raises(EngineUserError, match="outside the vocab"):
        failed.result(timeout=5)
    assert done2.result(timeout=5) == "op2"


def test_samples_queued_while_the_worker_is_busy_run_as_one_batch(worker: EngineWorker) -> None:
    release = threading.Event()
    busy = worker.call("busy", lambda engine: release.wait(5))
    results: list[Future] = []
    for i in range(5):
        done: Future = Future()
        results.append(done)
        worker.submit_sample(SampleJob(f"s{i}", SampleSpec(prompt_tokens=(1, 2)), done.set_result, done.set_exception))
    release.set()
    busy.result(timeout=5)
    assert all(len(r.result(timeout=5).sequences) == 1 for r in results)
    assert worker.engine.batches == [["s0", "s1", "s2", "s3", "s4"]]


@contextmanager
def _running(engine, **linger: float) -> Iterator[EngineWorker]:
    """A started worker over ``engine`` with the given linger settings, stopped afterwards."""
    w = EngineWorker(engine, **linger)
    w.start()
    try:
        yield w
    finally:
        w.stop()


def _all_answered(results: list[Future]) -> bool:
    return all(len(r.result(timeout=10).sequences) == 1 for r in results)


def _submit_spaced(worker: EngineWorker, count: int, gap_s: float) -> list[Future]:
    results: list[Future] = []
    for i in range(count):
        if i:
            time.sleep(gap_s)
        done: Future = Future()
        results.append(done)
        worker.submit_sample(SampleJob(f"s{i}", SampleSpec(prompt_tokens=(1, 2)), done.set_result, done.set_exception))
    return results


def test_an_idle_stream_waits_for_a_burst_to_end_before_it_starts() -> None:
    """Requests a few ms apart (the SDK sends a group's requests one by one) prefill as one batch."""
    with _running(BatchRecorder(), sample_linger_s=0.3, sample_burst_gap_s=0.4, sample_linger_max_s=5.0) as w:
        # the burst lasts 0.5 s, longer than the lone linger: a fixed linger after the first would split it
        assert _all_answered(_submit_spaced(w, 6, gap_s=0.1))
        assert w.engine.batches == [[f"s{i}" for i in range(6)]]


def test_a_burst_that_never_ends_starts_after_the_longest_linger() -> None:
    """A steady trickle does not hold the first request back longer than ``sample_linger_max_s``."""
    with _running(BatchRecorder(), sample_linger_s=0.3, sample_burst_gap_s=1.0, sample_linger_max_s=0.3) as w:
        assert _all_answered(_submit_spaced(w, 10, gap_s=0.1))
        assert len(w.engine.batches) >= 2  # with the quiet gap alone, all ten would have waited for the last
        assert len(w.engine.batches[0]) < 10


def test_a_lone_request_does_not_wait_for_a_burst_gap() -> None:
    """A client sampling one request at a time pays ``sample_linger_s``, not the burst's quiet gap."""
    with _running(BatchRecorder(), sample_linger_s=0.0, sample_burst_gap_s=30.0, sample_linger_max_s=60.0) as w:
        for _ in range(3):  # each answered within 10 s, far less than the 30 s gap
            assert _all_answered(_submit_spaced(w, 1, gap_s=0.0))
        assert w.engine.batches == [["s0"]] * 3


class SlowStream:
    """A continuous-batching stream whose requests take three steps of 50 ms; records each step's admissions."""

    def __init__(self) -> None:
        self.running: dict = {}
        self.new: list = []
        self.admissions: list[int] = []

    @property
    def busy(self) -> bool:
        return bool(self.running or self.new)

    def submit(self, key, sampler_id, spec) -> None:
        self.new.append(key)

    def step(self):
        if self.new:
            self.admissions.append(len(self.new))
        self.running.update(dict.fromkeys(self.new, 3))
        self.new = []
        time.sleep(0.05)
        done = [key for key, left in self.running.items() if left == 1]
        self.running = {key: left - 1 for key, left in self.running.items() if left > 1}
        return [(key, SampleResult([SampledSequence([1], [-0.5], "length")])) for key in done]


class SlowEngine:
    def __init__(self) -> None:
        self.stream = SlowStream()

    def sample_stream(self) -> SlowStream:
        return self.stream


def test_after_a_split_burst_a_first_request_waits_for_the_rest() -> None:
    """A lone request starts at once until the stream has seen a burst (here: a request joining 50 ms after
    an idle start); from then on a first request waits for the burst's quiet gap, and the burst is one admission."""
    engine = SlowEngine()
    with _running(engine, sample_linger_s=0.0, sample_burst_gap_s=0.3, sample_linger_max_s=2.0) as w:
        assert _all_answered(_submit_spaced(w, 2, gap_s=0.05))  # the second joins the first's running batch
        assert engine.stream.admissions == [1, 1]
        assert _all_answered(_submit_spaced(w, 2, gap_s=0.1))
        assert engine.stream.admissions == [1, 1, 2]


def test_stop_fails_queued_work_instead_of_running_it() -> None:
    w = EngineWorker(BatchRecorder())
    w.register_model("m")
    job, done = _op([], "op2")
    w.submit_model_op("m", 2, "req2", job)  # waits for seq 1 forever
    w.start()
    w.stop()
    with pytest.raises(RuntimeError, match="shutting down"):
        done.result(timeout=5)
