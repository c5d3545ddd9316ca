"""Continuous batching over every sampler of an engine: requests join at the next decode step.

The protocol's worker calls :meth:`SampleStream.submit` as requests arrive and :meth:`SampleStream.step`
when sampling gets its turn; each step admits what fits in the KV budget (prefill), runs one decode step
for every running batch, and returns every request that just completed. Requests of different weights
(samplers of different training runs or steps) decode in separate batches, one adapter each, stepped in
turn; the pending requests of different samplers are admitted round-robin, so a flood from one client
does not hold another's requests back.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from localtinker.engine.api import EngineUserError, SampleResult, SampleSpec
from localtinker.engine.decode_batch import DecodeBatch, SamplingStats

# Σ (prompt + samples × max_tokens) decoding at once (a prompt's keys are stored once for its samples,
# shared_prompt_kv.py): bounds KV-cache memory (~46 KB per token on SmolLM2-135M).
SAMPLE_BATCH_TOKENS = 65536

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


class SamplingBackend(Protocol):
    def prepare_sample(self, sampler_id: str, spec: SampleSpec) -> tuple[str, SampleSpec]:
        """Validates a request; returns (weights key, spec with defaults resolved). Raises EngineUserError."""
        ...

    def sampling_target(self, sampler_id: str) -> SamplingTarget:
        """Loads (and holds until ``release``) the sampler's weights."""
        ...


@dataclass
class _Pending:
    key: Hashable
    sampler_id: str
    weights: str
    spec: SampleSpec

    @property
    def cost(self) -> int:
        return len(self.spec.prompt_tokens) + self.spec.num_samples * self.spec.max_tokens


@dataclass
class _Group:
    target: SamplingTarget
    batch: DecodeBatch
    keys: set  # requests admitted and not yet complete


class SampleStream:
    def __init__(self, backend: SamplingBackend, budget_tokens: int = SAMPLE_BATCH_TOKENS) -> None:
        self.backend = backend
        self.budget_tokens = budget_tokens
        self.stats = SamplingStats()
        self._pending: OrderedDict[str, deque[_Pending]] = OrderedDict()  # per sampler, served round-robin
        self._rejected: Completed = []
        self._groups: dict[str, _Group] = {}
        self._costs: dict[Hashable, int] = {}

    @property
    def busy(self) -> bool:
        """Something to do at the next step: requests waiting, decoding, or answers to hand back."""
        return bool(self._pending or self._groups or self._rejected)

    def submit(self, key: Hashable, sampler_id: str, spec: SampleSpec) -> None:
        """Queues a request for admission at the next step; ``key`` identifies it in the step results."""
        try:
            weights, spec = self.backend.prepare_sample(sampler_id, spec)
        except EngineUserError as error:
            self._rejected.append((key, error))
            return
        self._pending.setdefault(sampler_id, deque()).append(_Pending(key, sampler_id, weights, spec))

    def step(self) -> Completed:
        """Admits what fits, runs one decode step for every batch; returns the requests completed."""
        completed, self._rejected = self._rejected, []
        for weights, admitted in self._admissions().items():
            completed += self._run(weights, lambda group: group.batch.admit([(p.key, p.spec) for p in admitted]),
                                   admitted)
        for weights in list(self._groups):
            completed += self._run(weights, lambda group: group.batch.step(), [])
        for key, _ in completed:
            self._costs.pop(key, None)
        return completed

    def _admissions(self) -> dict[str, list[_Pending]]:
        """Pending requests that fit the KV budget, taken round-robin across samplers, grouped by weights."""
        used = sum(self._costs.values())
        admitted: dict[str, list[_Pending]] = {}
        while self._pending:
            sampler_id, queue = next(iter(self._pending.items()))
            request = queue[0]
            if used and used + request.cost > self.budget_tokens:
                break
            queue.popleft()
            self._pending.move_to_end(sampler_id)
            if not queue:
                del self._pending[sampler_id]
            used += request.cost
            self._costs[request.key] = request.cost
            admitted.setdefault(request.weights, []).append(request)
        return admitted

    def _run(self, weights: str, action: Callable[[_Group], list], admitted: list[_Pending]) -> Completed:
        """Runs ``action`` on a weights group (created on first use); a failure fails that group's requests."""
        group = self._groups.get(weights)
        try:
            if group is None:
                target = self.backend.sampling_target(admitted[0].sampler_id)
                batch = DecodeBatch(target.model, target.tokenizer, target.eos_token_ids, target.pad_token_id, self.stats)
                group = self._groups[weights] = _Group(target, batch, set())
            group.keys.update(p.key for p in admitted)
            with group.target.activate():
                completed = action(group)
        except Exception as error:  # noqa: BLE001 - one weights group's failure must not fail the others
            keys = (group.keys if group else set()) | {p.key for p in admitted}
            completed = [(key, error) for key in keys]
            if group is not None:
                group.batch.rows.clear()
        if group is not None:
            group.keys.difference_update(key for key, _ in completed)
            if not group.batch.live_rows:
                del self._groups[weights]
                group.target.release()
        return completed
