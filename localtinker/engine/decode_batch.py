"""The running rows of one set of weights: requests join between decode steps, finished rows leave.

``admit`` prefills each *distinct* prompt of the new requests once (a GRPO group of G samples, or G
requests with the same prompt, costs one prefill), and a prompt that a row already in the batch holds
is not prefilled at all: the new rows point at the prompt already cached. Prompts are prefilled in
chunks of about one length (:func:`length_chunks`), so a long prompt does not pad the short ones. A
prefix shared by all the distinct prompts of one admission (a system prompt) is prefilled once too.
A prompt that extends a sequence kept in the ``PrefixStore`` (an earlier turn of the same conversation,
``prefix_store.py``) starts from that sequence's keys and values and prefills only the rest.
The first token of every new row is sampled from its prompt's last logits, then the rows join the
running cache, where a prompt's keys and values are stored once for all the rows that extend it
(``shared_prompt_kv.py``).

``step`` runs one decode step for every row in the batch; rows that finished leave the cache once a
quarter of the batch has (re-indexing the cache costs a copy), and their requests are returned as
soon as their last row finishes, so a short request never waits for a long one.

Every row's sampling is independent of its neighbours (own generator, explicit positions, masked
padding), so a request gets the same tokens and logprobs whether it decodes alone or in a crowd.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from localtinker.engine.api import EngineUserError, SampledSequence, SampleResult, SampleSpec
from localtinker.engine.attention import NAME as SHARED_PROMPT_ATTENTION
from localtinker.engine.kv_rows import ColumnBufferLayer, RowCache, select_rows
from localtinker.engine.logprobs import next_token_logit_blocks, next_token_logits, token_logprobs
from localtinker.engine.packed_linear import pack_frozen_linears, packed_sampling
from localtinker.engine.prefix_store import KeptSequence, PrefixStore
from localtinker.engine.sampler import SampleRow, choose_tokens, record_token, rows_for
from localtinker.engine.shared_prompt_kv import SharedPromptCache, close_widths, width_class

MIN_SHARED_PREFIX = 8
PREFILL_CHUNK_TOKENS = 16384  # padded tokens per prefill forward: bounds its activations
_COMPACT_FRACTION = 0.25


@dataclass
class SamplingStats:
    """Counters that show the scheduling at work (tests and benchmarks read them)."""

    requests: int = 0  # admissions (a preempted request is admitted again)
    prefill_tokens: int = 0  # prompt tokens run through the model (shared prefixes and prompts excluded)
    reused_prefix_tokens: int = 0  # prompt tokens whose keys and values came from the prefix store
    prefill_padding: int = 0  # padding run through the model beside them (prompts of unequal length)
    shared_prompts: int = 0  # requests whose prompt a decoding row had cached (shared, not prefilled)
    decode_steps: int = 0
    joined_mid_decode: int = 0  # requests admitted while other rows of the batch were decoding
    preempted: int = 0  # requests sent back to the queue to free KV memory (sample_stream.py)


@dataclass(eq=False)
class _Request:
    key: Hashable
    spec: SampleSpec
    rows: list[SampleRow] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    first_logits: torch.Tensor | None = None  # float32 [vocab] after the last prompt token
    holder: int | None = None  # a row whose cached prompt this request shares; None: prefilled
    unfinished: int = 0
    continuation: bool = False  # its prompt extends a kept sequence: its samples are kept when they finish

    def result(self) -> SampleResult:
        sequences = [SampledSequence(row.tokens, row.logprobs, row.stop_reason or "length") for row in self.rows]
        return SampleResult(sequences=sequences, prompt_logprobs=self.prompt_logprobs)


def shared_prefix_length(prompts: list[tuple[int, ...]]) -> int:
    """Tokens shared by every prompt (leaving each at least one of its own), or 0 when not worth sharing."""
    if len(prompts) < 2:
        return 0
    limit = min(len(prompt) for prompt in prompts) - 1
    first = prompts[0]
    length = 0
    while length < limit and all(prompt[length] == first[length] for prompt in prompts):
        length += 1
    return length if length >= MIN_SHARED_PREFIX else 0


@dataclass
class _PrefillChunk:
    """Prompts of close lengths prefilled together (``prompts``: their indices in the admission)."""

    prompts: list[int]
    cache: RowCache
    mask: torch.Tensor  # [prompts, width]


@dataclass
class _Prefill:
    chunks: list[_PrefillChunk]
    last_logits: torch.Tensor  # [prompts, vocab], in the admission's order
    prompt_hidden: list[torch.Tensor | None]  # per prompt: hidden states of every prompt token (None: reused)


@dataclass
class _Past:
    """Keys and values a prefill chunk starts from, per row right-aligned in ``columns`` (0/1 ``mask``)."""

    cache: RowCache
    mask: torch.Tensor  # [prompts, columns]
    lengths: torch.Tensor  # [prompts] real columns: the position of each row's first suffix token

    @staticmethod
    def empty(count: int) -> _Past:
        return _Past(RowCache(), torch.zeros((count, 0), dtype=torch.long), torch.zeros(count, dtype=torch.long))


def length_chunks(lengths: list[int], max_tokens: int = PREFILL_CHUNK_TOKENS) -> list[list[int]]:
    """Indices of ``lengths`` grouped for prefill, shortest first: a group takes the next length while
    that is close to the group's shortest (``shared_prompt_kv.close_widths``: padding at most ~¼, or a
    few columns; every length up to 32 is close to every other, as in ``width_class``), at most
    ``max_tokens`` padded tokens per group (one prompt longer than that is a group of its own). Every
    prompt padded to the longest of the admission made a 1000-token prompt among 63 short ones cost
    64 × 1000 tokens of prefill; each further group costs a whole forward's per-op time, so groups are as
    few as that padding bound allows (bench/bench_rl_sampling.py's long-prompt line)."""
    chunks: list[list[int]] = []
    shortest = 0
    for index in sorted(range(len(lengths)), key=lengths.__getitem__):
        length = lengths[index]
        close = width_class(length) == 0 or close_widths(shortest, length)
        if chunks and close and (len(chunks[-1]) + 1) * length <= max_tokens:
            chunks[-1].append(index)
        else:
            chunks.append([index])
            shortest = length
    return chunks


class DecodeBatch:
    """Rows decoding together over one model whose adapter the caller has switched on."""

    def __init__(self, model: torch.nn.Module, tokenizer: object, eos_token_ids: tuple[int, ...], pad_token_id: int,
                 stats: SamplingStats | None = None, prefixes: PrefixStore | None = None, weights: str = "") -> None:
        implementation = getattr(model.config, "_attn_implementation", None)
        if implementation != SHARED_PROMPT_ATTENTION:
            raise EngineUserError(
                f"sampling needs the model to use transformers' sdpa attention (localtinker replaces it by "
                f"its own, which shares a prompt's keys across samples); this model uses {implementation!r}."
            )
        pack_frozen_linears(model)  # once per model: measured at the first sampling, see packed_linear.py
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self.stats = stats or SamplingStats()
        self.prefixes = prefixes if prefixes is not None and prefixes.enabled else None
        self.weights = weights  # names the weights for the prefix store
        self.rows: list[SampleRow] = []  # in cache order; finished rows stay until the next compaction
        self.layers = int(model.config.num_hidden_layers)
        self.cache = SharedPromptCache(self.layers)
        self.next_tokens = torch.zeros((0,), dtype=torch.long)
        self.next_positions = torch.zeros((0,), dtype=torch.long)

    @property
    def live_rows(self) -> int:
        return sum(row.stop_reason is None for row in self.rows)

    @torch.inference_mode()
    @packed_sampling()
    def admit(self, requests: list[tuple[Hashable, SampleSpec]]) -> list[tuple[Hashable, SampleResult]]:
        """Adds requests to the batch; returns those already complete (max_tokens 0 or 1, or an instant stop)."""
        self._compact()
        joining_mid_decode = bool(self.rows)
        records = [_Request(key, spec) for key, spec in requests]
        holders = self._prompt_holders()
        fresh = dict.fromkeys(
            r.spec.prompt_tokens for r in records if r.spec.prompt_logprobs or r.spec.prompt_tokens not in holders
        )
        position = {prompt: index for index, prompt in enumerate(fresh)}  # in the prefill
        reused = self._reused_prefixes(list(position), {r.spec.prompt_tokens for r in records if r.spec.prompt_logprobs})
        prefill = self._prefill(list(position), reused) if position else None
        for record in records:
            record.rows = rows_for(record, record.spec, self.eos_token_ids)
            record.unfinished = len(record.rows)
            if record.spec.prompt_logprobs or record.spec.prompt_tokens not in holders:
                index = position[record.spec.prompt_tokens]
                record.first_logits = prefill.last_logits[index]
                record.continuation = reused[index] is not None
                if record.spec.prompt_logprobs:
                    record.prompt_logprobs = self._prompt_logprobs(prefill.prompt_hidden[index], record.spec)
            else:
                record.holder = holders[record.spec.prompt_tokens]
                holder = self.rows[record.holder].request
                record.first_logits, record.continuation = holder.first_logits, holder.continuation
                self.stats.shared_prompts += 1
        self.stats.requests += len(records)
        self.stats.joined_mid_decode += len(records) if joining_mid_decode else 0
        done = [record for record in records if record.spec.max_tokens == 0]
        for record in done:
            for row in record.rows:
                row.stop_reason = "length"
        starting = [row for record in records if record.spec.max_tokens > 0 for row in record.rows]
        if starting:
            tokens, logprobs = choose_tokens(torch.stack([row.request.first_logits for row in starting]), starting)
            done += self._record(starting, tokens.tolist(), logprobs.tolist())
            continuing = [i for i, row in enumerate(starting) if row.stop_reason is None]
            self._join([starting[i] for i in continuing], tokens[continuing], position, prefill)
        return [(record.key, record.result()) for record in done]

    @torch.inference_mode()
    @packed_sampling()
    def step(self) -> list[tuple[Hashable, SampleResult]]:
        """One decode step for every row; returns the requests whose last row just finished."""
        live = [i for i, row in enumerate(self.rows) if row.stop_reason is None]
        if not live:
            return []
        self.cache.open_column()
        output = self.decoder(
            input_ids=self.next_tokens[:, None],
            position_ids=self.next_positions[:, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        self.stats.decode_steps += 1
        self.next_positions = self.next_positions + 1
        live_rows = [self.rows[i] for i in live]
        tokens = torch.empty(len(live), dtype=torch.long)
        logprobs = torch.empty(len(live), dtype=torch.float32)
        for start, stop, logits in next_token_logit_blocks(output.last_hidden_state[live, -1], self.lm_head):
            tokens[start:stop], logprobs[start:stop] = choose_tokens(logits, live_rows[start:stop])
        self.next_tokens[live] = tokens
        done = self._record(live_rows, tokens.tolist(), logprobs.tolist())
        if self.prefixes is not None:
            self._keep_finished_continuations(live)
        if len(self.rows) - self.live_rows >= max(1, int(_COMPACT_FRACTION * len(self.rows))):
            self._compact()
        return [(record.key, record.result()) for record in done]

    def progress(self, key: Hashable) -> list[list[int]] | None:
        """The tokens each sample of request ``key`` has so far (None: no row of it decodes here)."""
        for row in self.rows:
            if row.request.key == key:
                return [list(sample.tokens) for sample in row.request.rows]
        return None

    def drop(self, keys: set[Hashable]) -> None:
        """Removes the rows of the requests ``keys`` and the finished rows now, freeing their columns (a
        preempted request starts over later)."""
        for row in self.rows:
            if row.request.key in keys and row.stop_reason is None:
                row.stop_reason = "preempted"
        self._compact()

    def _record(self, rows: list[SampleRow], tokens: list[int], logprobs: list[float]) -> list[_Request]:
        done = []
        for row, token, logprob in zip(rows, tokens, logprobs):
            if record_token(row, token, logprob, self.tokenizer):
                row.request.unfinished -= 1
                if row.request.unfinished == 0:
                    row.request.first_logits = None
                    done.append(row.request)
        return done

    def _reused_prefixes(self, prompts: list[tuple[int, ...]],
                         whole: set[tuple[int, ...]]) -> list[tuple[KeptSequence, int] | None]:
        """Per prompt, the kept sequence it extends and the tokens reused, or None (``whole``: prompts
        whose every hidden state is needed, for prompt logprobs, are prefilled whole)."""
        if self.prefixes is None:
            return [None] * len(prompts)
        return [None if prompt in whole else self.prefixes.longest_prefix(self.weights, prompt) for prompt in prompts]

    def _keep_finished_continuations(self, indices: list[int]) -> None:
        """Keeps prompt + completion of the rows ``indices`` that just finished, if their request extended a
        kept sequence: the next turn of that conversation will extend them in turn (prefix_store.py)."""
        for index in indices:
            row = self.rows[index]
            own = len(row.tokens) - 1  # the last token was sampled, never run through the model
            if row.stop_reason is None or row.stop_reason == "preempted" or not row.request.continuation or own < 1:
                continue
            keys, values = self.cache.row_keys_values(index, own)
            self.prefixes.keep(self.weights, row.request.spec.prompt_tokens + tuple(row.tokens[:-1]), keys, values,
                               proven=True)

    def _prompt_holders(self) -> dict[tuple[int, ...], int]:
        """Prompt -> index of a row in the batch whose cache holds that prompt."""
        holders: dict[tuple[int, ...], int] = {}
        for index, row in enumerate(self.rows):
            holders.setdefault(row.request.spec.prompt_tokens, index)
        return holders

    def _join(self, rows: list[SampleRow], first_tokens: torch.Tensor, position: dict[tuple[int, ...], int],
              prefill: _Prefill | None) -> None:
        """Adds the new rows to the running cache: fresh prompts from the prefill, the others already cached."""
        if not rows:
            return
        fresh = [row for row in rows if row.request.holder is None]
        sharing = [row for row in rows if row.request.holder is not None]
        prompt_ids = []
        if fresh:
            in_prefill = [position[row.request.spec.prompt_tokens] for row in fresh]
            needed, cached = set(in_prefill), {}
            for chunk in prefill.chunks:
                used = [local for local, index in enumerate(chunk.prompts) if index in needed]
                if used:
                    first = self.cache.add_prompts(chunk.cache, chunk.mask, torch.tensor(used))
                    cached.update((chunk.prompts[local], first + k) for k, local in enumerate(used))
            # Rows in the order of their prompts' ids (stable: a request's samples stay in order), so that
            # the attention's per-prompt products read the queries as they lie (RowGroups.in_row_order);
            # the prefill numbers prompts by length chunk, not by request.
            fresh_ids = [cached[index] for index in in_prefill]
            by_prompt = sorted(range(len(fresh)), key=fresh_ids.__getitem__)
            fresh = [fresh[i] for i in by_prompt]
            prompt_ids += [fresh_ids[i] for i in by_prompt]
        if sharing:
            prompt_ids += self.cache.prompt_of_row[[row.request.holder for row in sharing]].tolist()
        self.cache.add_rows(torch.tensor(prompt_ids, dtype=torch.long))
        ordered = fresh + sharing
        by_row = {id(row): token for row, token in zip(rows, first_tokens.tolist())}
        self.next_tokens = torch.cat([self.next_tokens, torch.tensor([by_row[id(row)] for row in ordered])])
        lengths = torch.tensor([len(row.request.spec.prompt_tokens) for row in ordered])
        self.next_positions = torch.cat([self.next_positions, lengths])
        self.rows += ordered

    def _compact(self) -> None:
        live = [i for i, row in enumerate(self.rows) if row.stop_reason is None]
        if len(live) == len(self.rows):
            return
        index = torch.tensor(live, dtype=torch.long)
        self.rows = [self.rows[i] for i in live]
        if live:
            self.cache.keep_rows(index)
        else:
            self.cache = SharedPromptCache(self.layers)
        self.next_tokens, self.next_positions = self.next_tokens[index], self.next_positions[index]

    def _prefill(self, prompts: list[tuple[int, ...]], reused: list[tuple[KeptSequence, int] | None]) -> _Prefill:
        """Prefills each distinct prompt once, in chunks of about equal length (:func:`length_chunks`): a
        prompt that extends a kept sequence from its keys and values; among the others, a prefix shared by
        all of them (a system prompt) once in total. Those others are kept in the prefix store."""
        chunks: list[_PrefillChunk] = []
        last_logits: torch.Tensor | None = None
        prompt_hidden: list[torch.Tensor | None] = [None] * len(prompts)

        def run(members: list[int], suffixes: list[tuple[int, ...]], past: _Past) -> torch.Tensor:
            nonlocal last_logits
            chunk, hidden = self._prefill_chunk(members, suffixes, past)
            chunks.append(chunk)
            logits = next_token_logits(hidden[:, -1], self.lm_head)
            if last_logits is None:
                last_logits = logits.new_empty((len(prompts), logits.shape[-1]))
            last_logits[members] = logits
            return hidden

        whole = [i for i, hit in enumerate(reused) if hit is None]
        if whole:
            self._prefill_whole(whole, [prompts[i] for i in whole], prompt_hidden, run)
        if self.prefixes is not None:  # a continuation's prompt is kept with its samples when they finish
            for chunk in chunks:
                self._keep_prompts(chunk, [prompts[i] for i in chunk.prompts])
        extending = [i for i, hit in enumerate(reused) if hit is not None]
        for group in length_chunks([len(prompts[i]) - reused[i][1] for i in extending]):
            members = [extending[k] for k in group]
            hits = [reused[i] for i in members]
            suffixes = [prompts[i][length:] for i, (_, length) in zip(members, hits)]
            run(members, suffixes, self._kept_past(hits, max(len(suffix) for suffix in suffixes)))
            self.stats.reused_prefix_tokens += sum(length for _, length in hits)
            self.stats.prefill_tokens += sum(len(suffix) for suffix in suffixes)
        return _Prefill(chunks, last_logits, prompt_hidden)

    def _prefill_whole(self, indices: list[int], prompts: list[tuple[int, ...]],
                       prompt_hidden: list[torch.Tensor | None], run) -> None:
        """Prefills ``prompts`` (the admission's ``indices``) from nothing: a prefix they all share once, then
        each one's suffix after that prefix's keys and values."""
        shared = shared_prefix_length(prompts)
        prefix, prefix_hidden = RowCache(), None
        if shared:
            output = self.decoder(
                input_ids=torch.tensor(prompts[0][:shared])[None],
                position_ids=torch.arange(shared)[None],
                past_key_values=prefix,
                use_cache=True,
            )
            prefix_hidden = output.last_hidden_state[0]
        suffixes = [prompt[shared:] for prompt in prompts]
        for group in length_chunks([len(suffix) for suffix in suffixes]):  # what the prefill pads
            past = _Past.empty(len(group))
            if shared:  # the prefix's keys and values copied to every prompt of the chunk
                copies = torch.zeros(len(group), dtype=torch.long)
                cache, mask = select_rows(prefix, torch.ones((1, shared), dtype=torch.long), copies)
                past = _Past(cache, mask, torch.full((len(group),), shared))
            hidden = run([indices[k] for k in group], [suffixes[k] for k in group], past)
            width = hidden.shape[1]
            for row, k in enumerate(group):
                own = hidden[row, width - len(suffixes[k]) :]
                prompt_hidden[indices[k]] = own if prefix_hidden is None else torch.cat([prefix_hidden, own])
        self.stats.prefill_tokens += shared + sum(len(suffix) for suffix in suffixes)

    def _kept_past(self, hits: list[tuple[KeptSequence, int]], suffix_width: int) -> _Past:
        """The reused keys and values of each prompt of a chunk, right-aligned (left padding masked), in
        buffers with exactly ``suffix_width`` spare columns: the prefill writes its columns in place, and
        the prompt shelf that takes the chunk takes these buffers without a copy."""
        lengths = torch.tensor([length for _, length in hits])
        width = int(lengths.max())
        mask = (torch.arange(width) >= width - lengths[:, None]).long()
        sample = hits[0][0]
        layers, heads, _, dim = sample.keys.shape
        keys = sample.keys.new_zeros((layers, len(hits), heads, width + suffix_width, dim))
        values = sample.values.new_zeros((layers, len(hits), heads, width + suffix_width, sample.values.shape[-1]))
        for row, (kept, length) in enumerate(hits):
            keys[:, row, :, width - length : width] = kept.keys[:, :, :length]
            values[:, row, :, width - length : width] = kept.values[:, :, :length]
        return _Past(RowCache([ColumnBufferLayer.over(k, v, width) for k, v in zip(keys, values)]), mask, lengths)

    def _keep_prompts(self, chunk: _PrefillChunk, prompts: list[tuple[int, ...]]) -> None:
        """Keeps each prompt of a prefill chunk with its keys and values: the chunk's real columns, gathered
        once per layer into one tensor, of which each kept prompt is a view."""
        mask = chunk.mask.bool()
        columns = torch.zeros((len(prompts), max(len(prompt) for prompt in prompts)), dtype=torch.long)
        for row in range(len(prompts)):
            real = mask[row].nonzero().flatten()
            columns[row, : len(real)] = real
        rows = torch.arange(len(prompts))[:, None]
        first = chunk.cache.layers[0]
        heads, dim = first.keys.shape[1], first.keys.shape[-1]
        keys = first.keys.new_empty((len(prompts), len(chunk.cache.layers), heads, columns.shape[1], dim))
        values = first.values.new_empty((*keys.shape[:-1], first.values.shape[-1]))
        for number, layer in enumerate(chunk.cache.layers):
            keys[:, number] = layer.keys[rows, :, columns].transpose(1, 2)
            values[:, number] = layer.values[rows, :, columns].transpose(1, 2)
        for row, prompt in enumerate(prompts):  # a row's real columns are its prompt's tokens, in order
            self.prefixes.keep(self.weights, prompt, keys[row, :, :, : len(prompt)], values[row, :, :, : len(prompt)])

    def _prefill_chunk(self, members: list[int], suffixes: list[tuple[int, ...]],
                       past: _Past) -> tuple[_PrefillChunk, torch.Tensor]:
        """One forward over ``suffixes`` (left-padded) after each row's ``past``; (chunk, hidden states)."""
        count = len(suffixes)
        width = max(len(suffix) for suffix in suffixes)
        input_ids = torch.full((count, width), self.pad_token_id, dtype=torch.long)
        suffix_mask = torch.zeros((count, width), dtype=torch.long)
        for index, suffix in enumerate(suffixes):
            input_ids[index, width - len(suffix) :] = torch.tensor(suffix, dtype=torch.long)
            suffix_mask[index, width - len(suffix) :] = 1
        # Left padding sits between the past and each suffix; the mask hides it and the explicit positions
        # keep every real token where it would be without padding.
        positions = past.lengths[:, None] + (suffix_mask.cumsum(-1) - 1).clamp(min=0)
        mask = torch.cat([past.mask, suffix_mask], dim=1)
        output = self.decoder(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=past.cache, use_cache=True
        )
        self.stats.prefill_padding += count * width - sum(len(suffix) for suffix in suffixes)
        return _PrefillChunk(members, past.cache, mask), output.last_hidden_state

    def _prompt_logprobs(self, hidden: torch.Tensor, spec: SampleSpec) -> list[float | None]:
        targets = torch.tensor(spec.prompt_tokens[1:], dtype=torch.long)
        temperature = spec.temperature if spec.temperature > 0 else 1.0
        return [None, *token_logprobs(hidden[:-1], self.lm_head, targets, temperature).tolist()]
