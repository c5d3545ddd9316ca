"""Three drivers of the same RL step pieces (``posttrain.rl.step``); they differ only in *when* each runs.

- :class:`SyncDriver` — on-policy: publish a sampler on the current weights, roll out the step's groups,
  then train on all of them (``num_substeps`` forward_backward calls, one optim_step).
- :class:`StreamingDriver` — on-policy, overlapped: the step's groups are split into ``num_substeps``
  minibatches and each minibatch's forward_backward is submitted as soon as its groups have finished,
  so the server trains while the slowest rollouts still sample. Advantages are per group, so this
  changes nothing but timing; the KL penalty's baseline mean is per minibatch.
- :class:`AsyncDriver` — off-policy: a background sampler keeps rolling out the dataset's groups with
  the newest sampler it has; each step takes ``groups_per_batch`` finished groups. A group sampled by a
  policy more than ``max_steps_off_policy`` steps older than the step is *stale*: dropped, or requeued
  to be sampled again with a newer policy (``stale_policy``); both are counted in the step's metrics.
  Which groups land in which step depends on timing, so an async run is not bit-reproducible and a
  resume restarts the stream at the resumed step's batch.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import tinker

from posttrain.completers import SamplingSettings, TokenCompleter
from posttrain.rl.config import RLConfig
from posttrain.rl.rollouts import derive_seed, iter_finished_groups, rollout_group
from posttrain.rl.step import (
    Minibatch,
    PendingRLStep,
    SampledGroup,
    Sampler,
    StepCounters,
    prepare_minibatch,
    publish_sampler,
    submit_forward_backward,
)
from posttrain.rl.types import EnvGroupBuilder, RLDataset

Decode = Callable[[Sequence[int]], str]


class _DriverBase:
    def __init__(self, config: RLConfig, dataset: RLDataset, decode: Decode, reference: tinker.SamplingClient | None):
        self.config = config
        self.dataset = dataset
        self.decode = decode
        self.reference = reference
        self.settings = SamplingSettings(max_tokens=config.max_tokens, temperature=config.temperature)

    def completer(self, sampler: Sampler) -> TokenCompleter:
        return TokenCompleter(sampler.client, self.settings)

    def group_seeds(self, batch: int, count: int) -> list[int]:
        return [derive_seed(self.config.training.seed, batch, index) for index in range(count)]

    def publish(self, training_client: tinker.TrainingClient, step: int) -> Sampler:
        return publish_sampler(training_client, step, self.config.training.checkpoint_ttl_seconds)

    def finish(self, step: int, training_client, adam, minibatches, counters, started) -> PendingRLStep:
        optim_future = training_client.optim_step(adam)
        return PendingRLStep(step, minibatches, optim_future, counters, self.decode, started)

    def start(self, training_client: tinker.TrainingClient, start_step: int) -> None:
        return None

    def close(self) -> None:
        return None


class SyncDriver(_DriverBase):
    def submit_step(self, step: int, training_client: tinker.TrainingClient, adam: tinker.AdamParams) -> PendingRLStep:
        sampler = self.publish(training_client, step)
        builders = self.dataset.get_batch(step)
        started = time.monotonic()
        finished = dict(iter_finished_groups(builders, self.completer(sampler), self.group_seeds(step, len(builders))))
        counters = StepCounters(sampling_seconds=time.monotonic() - started)
        sampled = [SampledGroup(finished[i], f"{step}.{i}", sampler.step, sampler.path) for i in range(len(builders))]
        minibatch = prepare_minibatch(sampled, self.config, self.reference)
        futures = submit_forward_backward(training_client, minibatch.datums, self.config, self.config.num_substeps)
        return self.finish(step, training_client, adam, [(minibatch, futures)], counters, started)


class StreamingDriver(_DriverBase):
    def submit_step(self, step: int, training_client: tinker.TrainingClient, adam: tinker.AdamParams) -> PendingRLStep:
        sampler = self.publish(training_client, step)
        builders = self.dataset.get_batch(step)
        sizes = _split_sizes(len(builders), self.config.num_substeps)
        started = time.monotonic()
        minibatches: list[tuple[Minibatch, list]] = []
        waiting: list[SampledGroup] = []
        for index, group in iter_finished_groups(builders, self.completer(sampler), self.group_seeds(step, len(builders))):
            waiting.append(SampledGroup(group, f"{step}.{index}", sampler.step, sampler.path))
            if len(waiting) == sizes[len(minibatches)]:
                minibatch = prepare_minibatch(waiting, self.config, self.reference)
                minibatches.append((minibatch, submit_forward_backward(training_client, minibatch.datums, self.config, 1)))
                waiting = []
        counters = StepCounters(sampling_seconds=time.monotonic() - started)
        return self.finish(step, training_client, adam, minibatches, counters, started)


def _split_sizes(total: int, parts: int) -> list[int]:
    parts = min(parts, total)
    return [total // parts + (1 if index < total % parts else 0) for index in range(parts)]


@dataclass(frozen=True)
class _Work:
    label: str  # "<batch>.<index>"
    builder: EnvGroupBuilder
    seed: int


class AsyncDriver(_DriverBase):
    """Background sampling with bounded work-ahead (2 × groups_per_batch groups); steps consume finished groups."""

    def __init__(self, config: RLConfig, dataset: RLDataset, decode: Decode, reference: tinker.SamplingClient | None):
        super().__init__(config, dataset, decode, reference)
        self._finished: queue.Queue[tuple[_Work, SampledGroup] | BaseException] = queue.Queue()
        self._requeued: collections.deque[_Work] = collections.deque()
        self._lock = threading.Lock()
        self._newest: Sampler | None = None
        self._stop = threading.Event()
        self._slots = threading.Semaphore(2 * config.groups_per_batch)
        self._in_flight = 0
        self._dataset_done = False
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None

    def start(self, training_client: tinker.TrainingClient, start_step: int) -> None:
        self._newest = self.publish(training_client, start_step)
        self._pool = ThreadPoolExecutor(max_workers=self.config.groups_per_batch, thread_name_prefix="rl-async")
        self._thread = threading.Thread(target=self._produce, args=(start_step,), name="rl-async-sampler", daemon=True)
        self._thread.start()

    def _dataset_work(self, start_step: int) -> Iterator[_Work]:
        for batch in range(start_step, len(self.dataset)):
            builders = self.dataset.get_batch(batch)
            for index, (builder, seed) in enumerate(zip(builders, self.group_seeds(batch, len(builders)))):
                yield _Work(f"{batch}.{index}", builder, seed)

    def _next_work(self, fresh: Iterator[_Work]) -> _Work | None:
        """A requeued group first, else the dataset's next one; None when there is neither (for now)."""
        with self._lock:
            if self._requeued:
                return self._requeued.popleft()
        work = next(fresh, None)
        if work is None:
            with self._lock:
                self._dataset_done = True
        return work

    def _produce(self, start_step: int) -> None:
        assert self._pool is not None
        fresh = self._dataset_work(start_step)
        while not self._stop.is_set():
            if not self._slots.acquire(timeout=0.1):
                continue
            work = self._next_work(fresh)
            if work is None:
                self._slots.release()
                self._stop.wait(0.1)
                continue
            with self._lock:
                sampler = self._newest
                self._in_flight += 1
            assert sampler is not None
            self._pool.submit(self._rollout, work, sampler)

    def _rollout(self, work: _Work, sampler: Sampler) -> None:
        try:
            group = rollout_group(work.builder, self.completer(sampler), derive_seed(work.seed, sampler.step))
            self._finished.put((work, SampledGroup(group, work.label, sampler.step, sampler.path)))
        except BaseException as error:  # surfaced to the step that waits for this group
            self._finished.put(error)
        finally:
            with self._lock:
                self._in_flight -= 1

    def submit_step(self, step: int, training_client: tinker.TrainingClient, adam: tinker.AdamParams) -> PendingRLStep:
        if self._newest is None:
            raise RuntimeError("AsyncDriver.submit_step before start(): the recipe starts its sampler in start()")
        if step > self._newest.step:
            newest = self.publish(training_client, step)
            with self._lock:
                self._newest = newest
        counters = StepCounters(off_policy=True)
        started = time.monotonic()
        fresh: list[SampledGroup] = []
        while len(fresh) < self.config.groups_per_batch:
            work, item = self._next_finished()
            self._slots.release()
            if step - item.sampler_step <= self.config.max_steps_off_policy:
                fresh.append(item)
            elif self.config.stale_policy == "requeue":
                counters.requeued_stale += 1
                with self._lock:
                    self._requeued.append(work)
            else:
                counters.dropped_stale += 1
        counters.sampling_seconds = time.monotonic() - started
        minibatch = prepare_minibatch(fresh, self.config, self.reference)
        futures = submit_forward_backward(training_client, minibatch.datums, self.config, self.config.num_substeps)
        return self.finish(step, training_client, adam, [(minibatch, futures)], counters, started)

    def _next_finished(self) -> tuple[_Work, SampledGroup]:
        while True:
            try:
                item = self._finished.get(timeout=0.2)
            except queue.Empty:
                with self._lock:
                    exhausted = self._dataset_done and not self._requeued and self._in_flight == 0
                if exhausted and self._finished.empty():
                    raise RuntimeError(
                        "the async sampler ran out of groups before the step was full: the dataset has no more "
                        "batches (stale groups dropped use up data; use stale_policy='requeue' or more batches)"
                    )
                continue
            if isinstance(item, BaseException):
                raise RuntimeError("an async rollout failed") from item
            return item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
