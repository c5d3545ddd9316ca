"""Batched, KV-cached sampling: every request and every ``num_samples`` row through one decode loop.

Prompts are left-padded and prefilled once per *request* (not per sample); the KV cache is then
replicated to ``num_samples`` rows, so a GRPO group of 16 costs one prefill. A prefix shared by all
prompts of a batch (typically the chat template's system prompt) is prefilled once. Each row carries its own
temperature, top-k, top-p, token budget, stop strings/ids and random generator (seeded from the
request seed and the row index, so the same seed gives the same samples whatever else is in the
batch). Finished rows are dropped from the batch as they accumulate.

Reported logprobs are those of the temperature-scaled, *unfiltered* distribution, computed by
:mod:`logprobs` exactly as the trainer computes them. Temperature 0 means greedy decoding; its
logprobs are then those of the unscaled distribution.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from localtinker.engine.api import EngineUserError, SampledSequence, SampleResult, SampleSpec
from localtinker.engine.logprobs import next_token_logits, token_logprobs

_SEED_STRIDE = 1_000_003
_COMPACT_FRACTION = 0.25


def validate_sample_spec(spec: SampleSpec, vocab_size: int, max_context: int) -> None:
    prompt = spec.prompt_tokens
    if not prompt:
        raise EngineUserError("sampling prompt is empty; a ModelInput needs at least one token.")
    bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise EngineUserError(
            f"prompt token {bad[0]!r} (position {list(prompt).index(bad[0])}) is outside the vocabulary "
            f"[0, {vocab_size}); tokenize with this model's tokenizer."
        )
    if spec.num_samples < 1:
        raise EngineUserError(f"num_samples must be >= 1, got {spec.num_samples}.")
    if spec.max_tokens is None or spec.max_tokens < 0:
        raise EngineUserError(f"SamplingParams.max_tokens must be >= 0, got {spec.max_tokens!r}.")
    if len(prompt) + spec.max_tokens > max_context:
        raise EngineUserError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({spec.max_tokens}) exceeds the model context of "
            f"{max_context}; shorten the prompt or lower max_tokens."
        )
    if not spec.temperature >= 0:
        raise EngineUserError(f"SamplingParams.temperature must be >= 0, got {spec.temperature}.")
    if not 0 < spec.top_p <= 1:
        raise EngineUserError(f"SamplingParams.top_p must be in (0, 1], got {spec.top_p}.")
    if spec.top_k < -1:
        raise EngineUserError(f"SamplingParams.top_k must be -1 (no limit) or >= 0, got {spec.top_k}.")
    for token in spec.stop_token_ids or ():
        if not 0 <= token < vocab_size:
            raise EngineUserError(f"stop token id {token} is outside the vocabulary [0, {vocab_size}).")
    if any(not isinstance(s, str) or not s for s in spec.stop_strings):
        raise EngineUserError("stop strings must be non-empty strings.")


MIN_SHARED_PREFIX = 8


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
class _Prefill:
    hidden: torch.Tensor  # [requests, suffix width, d], left-padded suffixes
    prefix_hidden: torch.Tensor | None  # [shared, d]
    suffix_lengths: list[int]
    cache: DynamicCache
    attention_mask: torch.Tensor
    last_positions: torch.Tensor

    @property
    def last_hidden(self) -> torch.Tensor:
        return self.hidden[:, -1]

    def prompt_hidden(self, index: int) -> torch.Tensor:
        """Hidden states of request ``index``'s whole prompt, without padding."""
        own = self.hidden[index, self.hidden.shape[1] - self.suffix_lengths[index] :]
        return own if self.prefix_hidden is None else torch.cat([self.prefix_hidden, own])


@dataclass
class _Row:
    request: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str | None = None


class BatchSampler:
    """Runs a list of :class:`SampleSpec` over one model (adapter already activated by the caller)."""

    def __init__(self, model: torch.nn.Module, tokenizer: object, eos_token_ids: tuple[int, ...], pad_token_id: int):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id

    @torch.inference_mode()
    def run(self, specs: list[SampleSpec]) -> list[SampleResult]:
        decoder = self.model.get_decoder()
        lm_head = self.model.get_output_embeddings()
        rows = [row for index, spec in enumerate(specs) for row in self._rows(index, spec)]
        prefill = self._prefill(decoder, specs)
        cache, attention_mask, positions = prefill.cache, prefill.attention_mask, prefill.last_positions
        prompt_logprobs = [
            self._prompt_logprobs(prefill.prompt_hidden(index), spec, lm_head) if spec.prompt_logprobs else None
            for index, spec in enumerate(specs)
        ]
        row_requests = torch.tensor([row.request for row in rows], dtype=torch.long)
        logits = next_token_logits(prefill.last_hidden, lm_head)[row_requests]
        live = [row for row in rows if row.max_tokens > 0]
        for row in rows:
            if row.max_tokens == 0:
                row.stop_reason = "length"
        if live:
            keep = torch.tensor([i for i, row in enumerate(rows) if row.max_tokens > 0], dtype=torch.long)
            cache.batch_select_indices(row_requests[keep])
            attention_mask = attention_mask[row_requests[keep]]
            positions = positions[row_requests[keep]]
            self._decode(decoder, lm_head, live, logits[keep], cache, attention_mask, positions)
        results = [SampleResult(sequences=[], prompt_logprobs=lp) for lp in prompt_logprobs]
        for row in rows:
            results[row.request].sequences.append(
                SampledSequence(tokens=row.tokens, logprobs=row.logprobs, stop_reason=row.stop_reason or "length")
            )
        return results

    def _rows(self, index: int, spec: SampleSpec) -> list[_Row]:
        stop_ids = self.eos_token_ids if spec.stop_token_ids is None else spec.stop_token_ids
        base_seed = spec.seed if spec.seed is not None else random.SystemRandom().randrange(2**62)
        rows = []
        for sample in range(spec.num_samples):
            generator = torch.Generator().manual_seed((base_seed * _SEED_STRIDE + sample) % (2**63))
            rows.append(
                _Row(
                    request=index,
                    max_tokens=spec.max_tokens,
                    temperature=spec.temperature,
                    top_k=spec.top_k,
                    top_p=spec.top_p,
                    stop_ids=frozenset(stop_ids),
                    stop_strings=tuple(spec.stop_strings),
                    generator=generator,
                )
            )
        return rows

    def _prefill(self, decoder: torch.nn.Module, specs: list[SampleSpec]) -> "_Prefill":
        """Prefills all prompts at once; a prefix shared by all of them (a system prompt) is computed once."""
        prompts = [spec.prompt_tokens for spec in specs]
        shared = shared_prefix_length(prompts)
        cache = DynamicCache()
        prefix_hidden = None
        if shared:
            prefix = torch.tensor(prompts[0][:shared], dtype=torch.long)[None]
            output = decoder(
                input_ids=prefix, position_ids=torch.arange(shared)[None], past_key_values=cache, use_cache=True
            )
            prefix_hidden = output.last_hidden_state[0]
            cache.batch_repeat_interleave(len(prompts))
        suffixes = [prompt[shared:] for prompt in prompts]
        width = max(len(suffix) for suffix in suffixes)
        input_ids = torch.full((len(specs), width), self.pad_token_id, dtype=torch.long)
        suffix_mask = torch.zeros((len(specs), width), dtype=torch.long)
        for index, suffix in enumerate(suffixes):
            input_ids[index, width - len(suffix) :] = torch.tensor(suffix, dtype=torch.long)
            suffix_mask[index, width - len(suffix) :] = 1
        # Left padding sits between the shared prefix and each suffix; the mask hides it and the explicit
        # positions keep every real token where it would be without padding.
        positions = shared + (suffix_mask.cumsum(-1) - 1).clamp(min=0)
        attention_mask = torch.cat([torch.ones((len(specs), shared), dtype=torch.long), suffix_mask], dim=1)
        output = decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        return _Prefill(
            hidden=output.last_hidden_state,
            prefix_hidden=prefix_hidden,
            suffix_lengths=[len(suffix) for suffix in suffixes],
            cache=output.past_key_values,
            attention_mask=attention_mask,
            last_positions=positions[:, -1],
        )

    def _prompt_logprobs(self, hidden: torch.Tensor, spec: SampleSpec, lm_head: torch.nn.Module) -> list[float | None]:
        prompt_hidden = hidden[:-1]
        targets = torch.tensor(spec.prompt_tokens[1:], dtype=torch.long)
        temperature = spec.temperature if spec.temperature > 0 else 1.0
        values = token_logprobs(prompt_hidden, lm_head, targets, temperature).tolist()
        return [None, *values]

    def _decode(self, decoder, lm_head, rows: list[_Row], logits, cache, attention_mask, positions) -> None:
        while True:
            chosen, chosen_logprobs = choose_tokens(logits, rows)
            for row, token, logprob in zip(rows, chosen.tolist(), chosen_logprobs.tolist()):
                if row.stop_reason is None:
                    row.tokens.append(token)
                    row.logprobs.append(logprob)
                    row.stop_reason = self._stop_reason(row, token)
            alive = [i for i, row in enumerate(rows) if row.stop_reason is None]
            if not alive:
                return
            if len(rows) - len(alive) >= max(1, int(_COMPACT_FRACTION * len(rows))):
                index = torch.tensor(alive, dtype=torch.long)
                cache.batch_select_indices(index)
                attention_mask, positions, chosen = attention_mask[index], positions[index], chosen[index]
                rows = [rows[i] for i in alive]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(rows), 1))], dim=1)
            positions = positions + 1
            output = decoder(
                input_ids=chosen[:, None],
                attention_mask=attention_mask,
                position_ids=positions[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            logits = next_token_logits(output.last_hidden_state[:, -1], lm_head)

    def _stop_reason(self, row: _Row, token: int) -> str | None:
        if token in row.stop_ids:
            return "stop"
        if row.stop_strings:
            window = max(len(s) for s in row.stop_strings) + 8
            text = self.tokenizer.decode(row.tokens[-window:])
            if any(stop in text for stop in row.stop_strings):
                return "stop"
        if len(row.tokens) >= row.max_tokens:
            return "length"
        return None


def choose_tokens(logits: torch.Tensor, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples one token per row; returns (tokens, their logprobs under the temperature-scaled distribution)."""
    temperatures = torch.tensor([row.temperature if row.temperature > 0 else 1.0 for row in rows])
    scaled = logits / temperatures[:, None]
    log_probs = torch.log_softmax(scaled, dim=-1)
    filtered = _filter_top_k_top_p(log_probs, rows)
    probs = torch.softmax(filtered, dim=-1)
    cdf = probs.cumsum(dim=-1)
    uniforms = torch.stack([torch.rand((), generator=row.generator) for row in rows])
    sampled = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(-1)
    sampled = sampled.clamp(max=logits.shape[-1] - 1)
    greedy = torch.tensor([row.temperature == 0 for row in rows])
    tokens = torch.where(greedy, scaled.argmax(dim=-1), sampled)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)


def _filter_top_k_top_p(log_probs: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
    vocab = log_probs.shape[-1]
    top_k = torch.tensor([row.top_k if 0 < row.top_k < vocab else vocab for row in rows])
    top_p = torch.tensor([row.top_p for row in rows])
    if bool((top_k == vocab).all()) and bool((top_p >= 1).all()):
        return log_probs
    sorted_logprobs, order = log_probs.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab)[None, :]
    probs_before = sorted_logprobs.exp().cumsum(dim=-1) - sorted_logprobs.exp()
    drop_sorted = (ranks >= top_k[:, None]) | ((probs_before >= top_p[:, None]) & (ranks > 0))
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return log_probs.masked_fill(drop, float("-inf"))
