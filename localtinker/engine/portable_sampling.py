"""The portable path's sampler (the CUDA path's; on the CPU, models the tuned path does not cover):
continuous batching over a KV cache on the model's device.

One :class:`_Batch` per set of weights holds its running rows' keys and values (``kv_rows.RowCache``: rows
left-padded to a common width, a 0/1 mask, explicit positions, columns written in place). Requests join at
the next step: their distinct prompts are prefilled together (each prompt once, then its cache copied to its
samples) and merged into the batch; finished rows leave, and columns no row attends to any more are dropped.
Attention, masks (sliding windows included) and the model's own layers are transformers'; the logits go
through ``chunked_logprobs.output_logits``, the trainer's function, so sampler and trainer agree.
With ``static_decode`` (the default on a GPU) the Llama-shaped families run instead over
``static_decode.StaticDecoder``'s preallocated cache: prefill through its own pieces, each prompt once and packed
without padding, and each decode step one CUDA graph replay.
Admission is bounded by a KV budget in tokens (prompt + samples × min(max_tokens, 1024), as the CPU stream's) and by
the device's memory: the caches that the admitted requests' rows will reach (rows × the longest row's columns,
rounded up as the caches are) must fit a share of what the device has free beside the caches held now. Requests
past either bound wait for rows to finish, so a burst larger than the card (an RL step's samples, an eval's
concurrent requests) runs in turns rather than failing out of memory.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from localtinker.engine.api import EngineUserError, SampledSequence, SampleResult, SampleSpec
from localtinker.engine.chunked_logprobs import chunked_token_logprobs, output_logits
from localtinker.engine.families import final_softcap
from localtinker.engine.kv_rows import RowCache, first_used_column, left_pad, select_rows
from localtinker.engine.memory_errors import SAMPLING_REMEDY, device_memory_error
from localtinker.engine.model_memory import available_bytes
from localtinker.engine.sample_stream import RESERVED_TOKENS_PER_SAMPLE, SamplingBackend, SamplingTarget
from localtinker.engine.sampler import SampleRow, record_token, rows_for
from localtinker.engine.static_decode import (
    CONTROLS, MIN_COLUMNS, SLOT_FLOOR, StaticDecoder, bucket, frozen_layer, static_decode_supported,
)
from localtinker.engine.token_choice import choose_tokens_on_device, filters, next_uniforms

# Σ (prompt + samples × min(max_tokens, 1024)) admitted at once. A GPU holds far more keys than a CPU can
# attend to per step: 64 prompts × 8 samples × 1024 tokens fit an 8B model's cache on an 80 GB card.
PORTABLE_BATCH_TOKENS = 1 << 20
# Of the memory free beside the caches held now, the share the admitted rows' caches may reach; the rest is for
# the step's logits and activations, and for the caches' growth between buckets.
CACHE_MEMORY_SHARE = 0.6

Completed = list[tuple[Hashable, SampleResult | Exception]]


@dataclass
class _Request:
    key: Hashable
    sampler_id: str
    weights: str
    spec: SampleSpec
    rows: list[SampleRow] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    left: int = 0  # rows still decoding

    def cost(self) -> int:
        return len(self.spec.prompt_tokens) + self.spec.num_samples * min(self.spec.max_tokens, RESERVED_TOKENS_PER_SAMPLE)

    def width(self) -> int:
        """The columns its rows reach: the prompt and the reserved new tokens."""
        return len(self.spec.prompt_tokens) + min(self.spec.max_tokens, RESERVED_TOKENS_PER_SAMPLE)

    def result(self) -> SampleResult:
        sequences = [SampledSequence(r.tokens, r.logprobs, r.stop_reason or "length") for r in self.rows]
        return SampleResult(sequences, self.prompt_logprobs)


@dataclass
class _Queued:
    """A static decode step on its way through the device, its tokens not read by the host yet."""

    rows: list[SampleRow]  # slot order when it was launched
    tokens: torch.Tensor  # host copies (pinned on a GPU), valid once ``ready`` has fired
    logprobs: torch.Tensor
    ready: torch.cuda.Event | None


class _Batch:
    """The running rows of one set of weights.

    With a static decoder and no row filtering its distribution (top-k/top-p), each decode step chooses its
    tokens inside the step's graph, and the batch keeps one step queued ahead: it launches step *t + 1*,
    then reads step *t*'s tokens, so the host's work (graph launch, stop checks) overlaps the device's.
    A row that finished at step *t* has run one step too many; that token is dropped.
    """

    def __init__(self, target: SamplingTarget, static: bool = False) -> None:
        self.target = target
        model = target.model
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.softcap = final_softcap(model.config)
        self.device = next(model.parameters()).device
        self.rows: list[SampleRow] = []
        self.cache: RowCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self.positions = torch.zeros((0,), dtype=torch.long, device=self.device)
        self.last = torch.zeros((0,), dtype=torch.long, device=self.device)
        self.static: StaticDecoder | None = None
        self.next_positions: list[int] = []  # static decode: each row's next position, on the host
        self.queued: _Queued | None = None
        self._host: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None, None]  # two turns
        self._turn = 0
        self.vocab = self.lm_head.weight.shape[0]
        if static and static_decode_supported(model):
            self.static = StaticDecoder.acquire(model)
            self.static.set_adapter(target.adapter)

    @property
    def cache_bytes(self) -> int:
        """Bytes its rows' keys and values hold now (the static decoder's whole cache, or the dynamic cache)."""
        if self.static is not None:
            return self.static.cache_bytes
        if self.cache is None:
            return 0
        return sum(t.numel() * t.element_size() for layer in self.cache.layers for t in (layer.keys, layer.values))

    def close(self, reusable: bool) -> None:
        """Returns the static decoder (its buffers and graphs) to the model's pool, unless a failure may have
        left it half-written."""
        if self.static is not None and reusable:
            self.static.release()
        self.static = None

    def admit(self, requests: list[_Request]) -> list[_Request]:
        """Prefills the requests' prompts and draws their first tokens; returns requests already complete."""
        done = self._collect()  # a queued step's rows take their token before others join
        prompts = list(dict.fromkeys(r.spec.prompt_tokens for r in requests))
        prompt_index = {prompt: i for i, prompt in enumerate(prompts)}
        new_rows: list[SampleRow] = []
        row_prompts: list[int] = []
        for request in requests:
            request.rows = rows_for(request, request.spec, self.target.eos_token_ids)
            request.left = len(request.rows) if request.spec.max_tokens > 0 else 0
            if request.left:
                new_rows += request.rows
                row_prompts += [prompt_index[request.spec.prompt_tokens]] * len(request.rows)
        start = len(self.rows)
        if self.static is not None:
            hidden, ends = self._prefill_static(prompts, new_rows, row_prompts)
        else:
            hidden, ends, cache, mask, positions = self._prefill_dynamic(prompts)
        for request in requests:
            if request.spec.prompt_logprobs:
                end = ends[prompt_index[request.spec.prompt_tokens]]
                request.prompt_logprobs = self._prompt_logprobs(hidden[: end + 1], request.spec)
            if request.left == 0:
                for row in request.rows:
                    row.stop_reason = "length"
                done.append(request)
        if not new_rows:
            return done
        chosen = torch.tensor(row_prompts, device=self.device)
        first_logits = output_logits(hidden[torch.tensor(ends, device=self.device)[chosen]], self.lm_head,
                                     self.softcap)
        if self.static is None:
            new_cache, new_mask = select_rows(cache, mask, chosen)
            self._merge(new_rows, new_cache, new_mask, positions[chosen, -1] + 1)
        return done + self._record(first_logits, new_rows, start=start)

    def _prefill_static(self, prompts: list[tuple[int, ...]], new_rows: list[SampleRow],
                        row_prompts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """The static decoder's prefill (each prompt once, its keys and values written into each new row's
        slot); returns the packed hidden states and each prompt's last row in them."""
        start = len(self.rows)
        self.rows += new_rows
        self.next_positions += [len(row.request.spec.prompt_tokens) for row in new_rows]
        self.static.reserve(max(len(self.rows), 1), max(len(p) for p in prompts) + 1)
        slots: list[list[int]] = [[] for _ in prompts]
        for offset, prompt in enumerate(row_prompts):
            slots[prompt].append(start + offset)
        hidden = self.static.prefill(prompts, slots)
        self.static.positions[start : len(self.rows)] = torch.tensor(self.next_positions[start:], device=self.device)
        return hidden, (np.cumsum([len(p) for p in prompts]) - 1).tolist()

    def _prefill_dynamic(self, prompts: list[tuple[int, ...]]):
        """transformers' layers over the prompts, left-padded to a common width, into a fresh RowCache; returns
        the hidden states flattened row by row, each prompt's last row in them, the cache, mask and positions."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.target.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = RowCache()
        hidden = self.decoder(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                              use_cache=True).last_hidden_state
        ends = [(row + 1) * width - 1 for row in range(len(prompts))]
        return hidden.reshape(len(prompts) * width, -1), ends, cache, mask, positions

    def step(self) -> list[_Request]:
        """One decode step for every row; returns the requests whose last row just finished."""
        if self.static is not None:
            if not filters(self.rows, self.vocab):
                launched = self._launch()
                done = self._collect()
                self.queued = launched
                return done
            done = self._collect()
            if not self.rows:
                return done
            rows, last = len(self.rows), max(self.next_positions)
            self.static.reserve(rows, last + 1)
            logits = self.static.step(rows, last)
            self.static.positions[:rows] += 1
            self.next_positions = [p + 1 for p in self.next_positions]
            return done + self._record(logits, self.rows, start=0)
        self.mask = torch.cat([self.mask, torch.ones((len(self.rows), 1), dtype=torch.long, device=self.device)], 1)
        hidden = self.decoder(input_ids=self.last[:, None], attention_mask=self.mask, position_ids=self.positions[:, None],
                              past_key_values=self.cache, use_cache=True).last_hidden_state[:, -1]
        self.positions = self.positions + 1
        return self._record(output_logits(hidden, self.lm_head, self.softcap), self.rows, start=0)

    def _launch(self) -> _Queued:
        """Queues a static step that chooses its tokens on the device; waits for nothing."""
        rows, last = len(self.rows), max(self.next_positions)
        self.static.reserve(rows, last + 1)
        controls, tokens, logprobs = self._host_buffers()
        width = bucket(rows)
        controls[:, rows:width] = torch.tensor([0.0, 1.0, 0.0, 0.0])[:, None]  # free slots: finite, not live
        controls[:, :rows] = torch.tensor([
            next_uniforms(self.rows),
            [row.temperature if row.temperature > 0 else 1.0 for row in self.rows],
            [float(row.temperature == 0) for row in self.rows],
            [1.0] * rows,
        ])
        self.static.controls[:, :width].copy_(controls[:, :width], non_blocking=True)
        self.static.step_and_choose(rows, last)
        tokens[:rows].copy_(self.static.tokens[:rows], non_blocking=True)
        logprobs[:rows].copy_(self.static.chosen_logprobs[:rows], non_blocking=True)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        self.next_positions = [p + 1 for p in self.next_positions]
        return _Queued(list(self.rows), tokens[:rows], logprobs[:rows], ready)

    def _host_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This turn's host buffers (controls, tokens, logprobs), sized to the decoder's slots. Two turns
        alternate: a step's buffers are reused two launches later, after its tokens were read."""
        self._turn ^= 1
        slots, kept = self.static.slots, self._host[self._turn]
        if kept is None or kept[1].shape[0] < slots:
            pin = self.device.type == "cuda"
            kept = self._host[self._turn] = (torch.empty((len(CONTROLS), slots), pin_memory=pin),
                                             torch.empty((slots,), dtype=torch.long, pin_memory=pin),
                                             torch.empty((slots,), dtype=torch.float32, pin_memory=pin))
        return kept

    def _collect(self) -> list[_Request]:
        """Reads the queued step's tokens into its rows (those still running); returns finished requests."""
        queued, self.queued = self.queued, None
        if queued is None:
            return []
        if queued.ready is not None:
            queued.ready.synchronize()
        return self._take(queued.rows, queued.tokens.tolist(), queued.logprobs.tolist())

    def _record(self, logits: torch.Tensor, rows: list[SampleRow], start: int) -> list[_Request]:
        tokens, logprobs = choose_tokens_on_device(logits, rows)
        (self.static.tokens if self.static is not None else self.last)[start : start + len(rows)] = tokens
        return self._take(rows, tokens.tolist(), logprobs.tolist())

    def _take(self, rows: list[SampleRow], tokens: list[int], logprobs: list[float]) -> list[_Request]:
        """Appends each still-running row's token, drops the rows that finished; returns finished requests."""
        done: list[_Request] = []
        tokenizer = self.target.tokenizer
        for row, token, logprob in zip(rows, tokens, logprobs):
            if row.stop_reason is None and record_token(row, token, logprob, tokenizer):
                row.request.left -= 1
                if row.request.left == 0:
                    done.append(row.request)
        if any(row.stop_reason for row in self.rows):
            self._keep([i for i, row in enumerate(self.rows) if row.stop_reason is None])
        return done

    def _merge(self, rows: list[SampleRow], cache: RowCache, mask: torch.Tensor, positions: torch.Tensor) -> None:
        last = torch.zeros((len(rows),), dtype=torch.long, device=self.device)
        if self.cache is None or not self.rows:
            self.cache, self.mask, self.positions, self.last = cache, mask, positions, last
            self.rows = list(rows)
            return
        width = max(self.mask.shape[1], mask.shape[1])
        layers = [
            type(old)(torch.cat([left_pad(old.keys, width), left_pad(new.keys, width)]),
                      torch.cat([left_pad(old.values, width), left_pad(new.values, width)]))
            for old, new in zip(self.cache.layers, cache.layers)
        ]
        self.cache = RowCache(layers)
        pad = lambda m: torch.cat([m.new_zeros((m.shape[0], width - m.shape[1])), m], dim=1)  # noqa: E731
        self.mask = torch.cat([pad(self.mask), pad(mask)])
        self.positions = torch.cat([self.positions, positions])
        self.last = torch.cat([self.last, last])
        self.rows += rows

    def _keep(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        if self.static is not None:
            self.next_positions = [self.next_positions[i] for i in keep]
            self.static.keep(torch.tensor(keep, dtype=torch.long, device=self.device), len(keep))
            return
        if not keep:
            self.cache, self.mask = None, self.mask[:0]
            self.positions, self.last = self.positions[:0], self.last[:0]
            return
        index = torch.tensor(keep, device=self.device)
        self.cache, self.mask = select_rows(self.cache, self.mask, index)
        first = first_used_column(self.mask)
        if first:  # columns no remaining row attends to
            self.cache = RowCache([type(layer)(layer.keys[:, :, first:], layer.values[:, :, first:]) for layer in self.cache.layers])
            self.mask = self.mask[:, first:]
        self.positions, self.last = self.positions[index], self.last[index]

    def _prompt_logprobs(self, hidden: torch.Tensor, spec: SampleSpec) -> list[float | None]:
        prompt = spec.prompt_tokens
        own = hidden[hidden.shape[0] - len(prompt):]
        targets = torch.tensor(prompt[1:], device=self.device)
        values = chunked_token_logprobs(own[:-1], self.lm_head, targets, self.softcap, spec.temperature or 1.0)
        return [None, *values.tolist()]


_MEASURED = "_localtinker_cache_bytes_per_token"  # on a base model: its measured cache bytes per token


def cache_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of keys and values one token holds in the sampler's cache of ``model``: each layer's k and v
    projections' outputs, in the model's dtype (as the static decoder and the dynamic cache keep them). Where a
    layer has no separate k and v projections (a fused qkv, latent attention, whose cache transformers keeps
    compressed) or the decoder's layers are not ``layers``, it is measured: what transformers' cache holds after
    a prompt of two tokens."""
    dtype = next(model.parameters()).dtype
    widths = []
    for layer in getattr(model.get_decoder(), "layers", None) or ():
        attention = getattr(layer, "self_attn", None)
        k, v = getattr(attention, "k_proj", None), getattr(attention, "v_proj", None)
        if k is None or v is None:
            return _measured_cache_bytes_per_token(model)
        widths.append(frozen_layer(k).out_features + frozen_layer(v).out_features)
    return sum(widths) * dtype.itemsize if widths else _measured_cache_bytes_per_token(model)


def _measured_cache_bytes_per_token(model: torch.nn.Module, tokens: int = 2) -> int:
    """Measured once per model (a property of the base model, asked again for each sampler's weights)."""
    if _MEASURED in model.__dict__:
        return model.__dict__[_MEASURED]
    device = model.get_output_embeddings().weight.device
    with torch.no_grad():
        cache = model(input_ids=torch.zeros(1, tokens, dtype=torch.long, device=device), use_cache=True,
                      logits_to_keep=1).past_key_values
    held = sum(tensor.nbytes for layer in cache.layers for tensor in (getattr(layer, "keys", None),
                                                                         getattr(layer, "values", None))
               if isinstance(tensor, torch.Tensor))
    model.__dict__[_MEASURED] = held // tokens
    return held // tokens


def projected_cache_bytes(requests: list[_Request], bytes_per_token: dict[str, int]) -> int:
    """What the caches of ``requests`` reach when all run at once: per set of weights (one batch, one cache),
    its rows × the longest row's columns, each rounded up to its bucket as the static decoder's are."""
    groups: dict[str, tuple[int, int]] = {}
    for request in requests:
        rows, width = groups.get(request.weights, (0, 0))
        groups[request.weights] = (rows + request.spec.num_samples, max(width, request.width()))
    return sum(bucket(rows, SLOT_FLOOR) * bucket(width, MIN_COLUMNS) * bytes_per_token[weights]
               for weights, (rows, width) in groups.items())


class PortableSampleStream:
    """``submit`` / ``step`` / ``busy`` as :class:`~localtinker.engine.sample_stream.SampleStream`."""

    def __init__(self, backend: SamplingBackend, budget_tokens: int = PORTABLE_BATCH_TOKENS,
                 static_decode: bool = False) -> None:
        self.backend = backend
        self.budget_tokens = budget_tokens
        self.static_decode = static_decode
        self._pending: deque[_Request] = deque()
        self._rejected: Completed = []
        self._batches: dict[str, _Batch] = {}
        self._admitted: dict[Hashable, _Request] = {}
        self._bytes_per_token: dict[str, int] = {}  # by weights: their base model's cache bytes per token

    @property
    def busy(self) -> bool:
        return bool(self._pending or self._batches or self._rejected)

    def submit(self, key: Hashable, sampler_id: str, spec: SampleSpec) -> None:
        try:
            weights, spec = self.backend.prepare_sample(sampler_id, spec)
        except EngineUserError as error:
            self._rejected.append((key, error))
            return
        if spec.seed is None:
            spec = replace(spec, seed=random.SystemRandom().randrange(2**62))
        self._pending.append(_Request(key, sampler_id, weights, spec))

    def progress(self, key: Hashable) -> list[list[int]] | None:
        request = self._admitted.get(key)
        return [list(row.tokens) for row in request.rows] if request is not None and request.rows else None

    def step(self) -> Completed:
        completed, self._rejected = self._rejected, []
        for weights, requests in self._admissions().items():
            completed += self._run(weights, requests, lambda batch: batch.admit(requests))
        for weights in list(self._batches):
            completed += self._run(weights, [], lambda batch: batch.step())
        return completed

    def _admissions(self) -> dict[str, list[_Request]]:
        """The pending requests that start now, in order, by weights: while the token budget and the device's
        memory (:meth:`_cache_room`) hold; with nothing running, the first one whatever its size (too large for
        the device, it then fails with an out-of-memory error naming what to send)."""
        used = sum(r.cost() for r in self._admitted.values())
        running = list(self._admitted.values())
        room = self._cache_room() if self._pending else None
        admitted: dict[str, list[_Request]] = {}
        while self._pending and (not used or used + self._pending[0].cost() <= self.budget_tokens):
            request = self._pending[0]
            if running and room is not None and self._projected([*running, request]) > room:
                break
            self._pending.popleft()
            used += request.cost()
            running.append(request)
            self._admitted[request.key] = request
            admitted.setdefault(request.weights, []).append(request)
        return admitted

    def _cache_room(self) -> int | None:
        """Bytes the running and admitted rows' caches may reach together: a share of the device's free memory
        plus what the running batches' caches hold now; None where the device's memory cannot be read."""
        room = available_bytes(self.backend.device)
        if room is None:
            return None
        held = sum(batch.cache_bytes for batch in self._batches.values())
        return int(CACHE_MEMORY_SHARE * (room[0] + held))

    def _projected(self, requests: list[_Request]) -> int:
        for request in requests:
            if request.weights not in self._bytes_per_token:
                self._bytes_per_token[request.weights] = self.backend.cache_bytes_per_token(request.sampler_id)
        return projected_cache_bytes(requests, self._bytes_per_token)

    def _run(self, weights: str, requests: list[_Request], action) -> Completed:
        batch = self._batches.get(weights)
        try:
            if batch is None:
                target = self.backend.sampling_target(requests[0].sampler_id)
                batch = self._batches[weights] = _Batch(target, self.static_decode)
            # Adapters load outside inference mode (their parameters must stay ordinary tensors).
            with batch.target.activate(), torch.inference_mode():
                done = action(batch)
            completed: Completed = [(r.key, r.result()) for r in done]
        except Exception as error:  # noqa: BLE001 - one weights group's failure must not fail the others
            keys = {r.key for r in requests} | {row.request.key for row in (batch.rows if batch else [])}
            error = device_memory_error(error, f"sampling {len(keys)} requests of one sampler", self.backend.device,
                                        SAMPLING_REMEDY)
            completed = [(key, error) for key in keys]
            if batch is not None:
                batch.rows = []
                batch.close(reusable=False)
        for key, _ in completed:
            self._admitted.pop(key, None)
        if batch is not None and not batch.rows:
            del self._batches[weights]
            batch.close(reusable=True)
            batch.target.release()
        return completed
