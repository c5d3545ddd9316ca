"""Continuous batching over every sampler of an engine: requests join at the next decode step.

The protocol's worker calls :meth:`SampleStream.submit` as requests arrive and :meth:`SampleStream.step`
when sampling gets its turn; each step admits what fits in the KV budget (prefill), runs one decode step
for every running batch, and returns every request that just completed. Requests of different weights
(samplers of different training runs or steps) decode in separate batches, one adapter each, stepped in
turn; the pending requests of different samplers are admitted round-robin, so a flood from one client
does not hold another's requests back.

Admission reserves each request's prompt and, per sample, ``max_tokens`` new tokens but at most
``reserved_tokens_per_sample`` (1024): a script that leaves ``max_tokens`` unset asks for the rest of the
context (8k tokens) and usually stops far earlier, and reserving all of it let one GRPO group decode at
a time. When the keys and values actually stored outgrow the budget (by the ``PADDING_ALLOWANCE`` the
cache's padding may take), the newest request is *preempted*: its rows leave, it goes back to the front
of the queue, and nothing more is admitted until some request completes. It starts over from its seed
(fixed at submission when the request has none), so it returns what it would have returned unpreempted.

The stream owns the :class:`PrefixStore` its batches share: a conversation's next turn usually arrives after
its batch has drained, so the keys and values of earlier turns are kept here, per weights, with a budget of
their own (``prefix_store.py``).
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from localtinker.engine.api import EngineUserError, SampleResult, SampleSpec
from localtinker.engine.decode_batch import DecodeBatch, SamplingStats
from localtinker.engine.memory_errors import SAMPLING_REMEDY, device_memory_error
from localtinker.engine.prefix_store import PrefixStore

# Σ (prompt + samples × min(max_tokens, RESERVED_TOKENS_PER_SAMPLE)) admitted at once (a prompt's keys
# are stored once for its samples, shared_prompt_kv.py): bounds KV-cache memory (~46 KB per token on
# SmolLM2-135M), together with preemption at PADDING_ALLOWANCE × the budget of columns actually stored.
SAMPLE_BATCH_TOKENS = 65536
RESERVED_TOKENS_PER_SAMPLE = 1024
PADDING_ALLOWANCE = 1.5  # stored columns include padding: at most ~¼ plus a few columns per row

Completed = list[tuple[Hashable, SampleResult | Exception]]


@dataclass(frozen=True)
class SamplingTarget:
    """Where a request decodes: a base model with (optionally) an adapter switched on."""

    model: torch.nn.Module
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    activate: Callable[[], AbstractContextManager]
    release: Callable[[], None]  # the weights may be evicted again once their batch has drained
    adapter: str | None = None  # the peft adapter ``activate`` switches on (None: the bare base model)


class SamplingBackend(Protocol):
    device: torch.device  # where the samplers' models compute

    def prepare_sample(self, sampler_id: str, spec: SampleSpec) -> tuple[str, SampleSpec]:
        """Validates a request; returns (weights key, spec with defaults resolved). Raises EngineUserError."""
        ...

    def sampling_target(self, sampler_id: str) -> SamplingTarget:
        """Loads (and holds until ``release``) the sampler's weights."""
        ...

    def cache_bytes_per_token(self, sampler_id: str) -> int:
        """Bytes of keys and values one token of the sampler's rows holds in the portable sampler's cache."""
        ...


@dataclass
class _Pending:
    key: Hashable
    sampler_id: str
    weights: str
    spec: SampleSpec

    def cost(self, reserved_per_sample: int) -> int:
        return len(self.spec.prompt_tokens) + self.spec.num_samples * min(self.spec.max_tokens, reserved_per_sample)


@dataclass
class _Group:
    target: SamplingTarget
    batch: DecodeBatch
    keys: set  # requests admitted and not yet complete


class SampleStream:
    def __init__(self, backend: SamplingBackend, budget_tokens: int = SAMPLE_BATCH_TOKENS,
                 reserved_tokens_per_sample: int = RESERVED_TOKENS_PER_SAMPLE,
                 prefix_budget_tokens: int | None = None) -> None:
        self.backend = backend
        self.prefixes = PrefixStore(prefix_budget_tokens)  # outlives batches: a conversation's turns come apart
        self.budget_tokens = budget_tokens
        self.reserved_tokens_per_sample = reserved_tokens_per_sample
        self.stats = SamplingStats()
        self._pending: OrderedDict[str, deque[_Pending]] = OrderedDict()  # per sampler, served round-robin
        self._rejected: Completed = []
        self._groups: dict[str, _Group] = {}
        self._admitted: dict[Hashable, _Pending] = {}  # decoding, oldest first
        self._held = False  # a request was preempted: admit nothing until one completes

    @property
    def busy(self) -> bool:
        """Something to do at the next step: requests waiting, decoding, or answers to hand back."""
        return bool(self._pending or self._groups or self._rejected)

    @property
    def stored_columns(self) -> int:
        """KV columns stored by every batch (per layer and key head, padding included)."""
        return sum(group.batch.cache.stored_columns for group in self._groups.values())

    def submit(self, key: Hashable, sampler_id: str, spec: SampleSpec) -> None:
        """Queues a request for admission at the next step; ``key`` identifies it in the step results."""
        try:
            weights, spec = self.backend.prepare_sample(sampler_id, spec)
        except EngineUserError as error:
            self._rejected.append((key, error))
            return
        if spec.seed is None:  # a preempted request starts over: from the same seed, it gives the same samples
            spec = replace(spec, seed=random.SystemRandom().randrange(2**62))
        self._pending.setdefault(sampler_id, deque()).append(_Pending(key, sampler_id, weights, spec))

    def progress(self, key: Hashable) -> list[list[int]] | None:
        """The tokens each sample of a decoding request has so far, for streaming (None: waiting or done). A
        preempted request starts over from its seed, so what it reports again is what it reported before."""
        request = self._admitted.get(key)
        group = self._groups.get(request.weights) if request is not None else None
        return group.batch.progress(key) if group is not None else None

    def step(self) -> Completed:
        """Admits what fits, runs one decode step for every batch; returns the requests completed."""
        completed, self._rejected = self._rejected, []
        if not self._held:
            for weights, admitted in self._admissions().items():
                completed += self._finished(self._run(
                    weights, lambda group: group.batch.admit([(p.key, p.spec) for p in admitted]), admitted))
        self._preempt_while_over_budget()
        for weights in list(self._groups):
            completed += self._finished(self._run(weights, lambda group: group.batch.step(), []))
        return completed

    def _finished(self, completed: Completed) -> Completed:
        for key, _ in completed:
            if self._admitted.pop(key, None) is not None:
                self._held = False
        return completed

    def _admissions(self) -> dict[str, list[_Pending]]:
        """Pending requests that fit the KV budget, taken round-robin across samplers, grouped by weights."""
        reserve = self.reserved_tokens_per_sample
        used = sum(request.cost(reserve) for request in self._admitted.values())
        admitted: dict[str, list[_Pending]] = {}
        while self._pending:
            sampler_id, queue = next(iter(self._pending.items()))
            request = queue[0]
            if used and used + request.cost(reserve) > self.budget_tokens:
                break
            queue.popleft()
            self._pending.move_to_end(sampler_id)
            if not queue:
                del self._pending[sampler_id]
            used += request.cost(reserve)
            self._admitted[request.key] = request
            admitted.setdefault(request.weights, []).append(request)
        return admitted

    def _preempt_while_over_budget(self) -> None:
        """Before a decode step, which adds a column per row: while that would overflow the budget (with its
        padding allowance), the newest request leaves its batch and waits at the front of its queue."""
        limit = PADDING_ALLOWANCE * self.budget_tokens
        compacted = False
        while len(self._admitted) > 1:
            if self.stored_columns + sum(group.batch.cache.rows for group in self._groups.values()) <= limit:
                return
            if not compacted:  # finished rows waiting for the next compaction leave first
                for group in self._groups.values():
                    group.batch.drop(set())
                compacted = True
                continue
            key, request = self._admitted.popitem()
            group = self._groups[request.weights]
            group.batch.drop({key})
            group.keys.discard(key)
            if not group.batch.live_rows:
                del self._groups[request.weights]
                group.target.release()
            self._pending.setdefault(request.sampler_id, deque()).appendleft(request)
            self._pending.move_to_end(request.sampler_id, last=False)
            self.stats.preempted += 1
            self._held = True

    def _run(self, weights: str, action: Callable[[_Group], list], admitted: list[_Pending]) -> Completed:
        """Runs ``action`` on a weights group (created on first use); a failure fails that group's requests."""
        group = self._groups.get(weights)
        try:
            if group is None:
                target = self.backend.sampling_target(admitted[0].sampler_id)
                batch = DecodeBatch(target.model, target.tokenizer, target.eos_token_ids, target.pad_token_id, self.stats,
                                    self.prefixes, weights)
                group = self._groups[weights] = _Group(target, batch, set())
            group.keys.update(p.key for p in admitted)
            with group.target.activate():
                completed = action(group)
        except Exception as error:  # noqa: BLE001 - one weights group's failure must not fail the others
            keys = (group.keys if group else set()) | {p.key for p in admitted}
            error = device_memory_error(error, f"sampling {len(keys)} requests of one sampler", self.backend.device,
                                        SAMPLING_REMEDY)
            completed = [(key, error) for key in keys]
            if group is not None:
                group.batch.rows.clear()
        if group is not None:
            group.keys.difference_update(key for key, _ in completed)
            if not group.batch.live_rows:
                del self._groups[weights]
                group.target.release()
        return completed
