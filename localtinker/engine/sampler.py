"""Per-row sampling: request validation, one row per sample, token choice and stop rules.

A row is one sample of one request. Each row carries its own temperature, top-k, top-p, token budget,
stop strings/ids and random generator, seeded from the request seed and the sample index, so the same
seed gives the same samples whatever else is decoding beside it, up to float rounding: BLAS sums 1-3
rows in another order than 4 or more (engine README, determinism). See ``decode_batch.py`` for the KV cache the rows
share and ``sample_stream.py`` for how requests join and leave.

Reported logprobs are those of the temperature-scaled, *unfiltered* distribution: at temperature 1 the
trainer's logprobs of the same tokens to ~1e-5 (float32; tested). Temperature 0 means greedy decoding;
its logprobs are then those of the unscaled distribution.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from localtinker.engine.api import EngineUserError, SampleSpec
from localtinker.engine.fast_exp import exp_

_SEED_STRIDE = 1_000_003
_UNIFORM_BLOCK = 256  # most uniforms drawn ahead per row (SampleRow.next_uniform)


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


@dataclass(eq=False)
class SampleRow:
    """One sample being generated; ``request`` is the owner's handle (the decode batch's request record)."""

    request: Any
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
    _uniforms: list[float] = field(default_factory=list, repr=False)

    def next_uniform(self) -> float:
        """The row's next draw from its generator. Drawn a block at a time: ``torch.rand(n)`` yields what ``n``
        scalar draws would, for a fraction of the host time (one scalar draw per row per decode step was
        ~0.3 ms per step at 64 rows, in the way of a GPU step of ~2 ms)."""
        if not self._uniforms:
            block = min(max(self.max_tokens - len(self.tokens), 1), _UNIFORM_BLOCK)
            self._uniforms = torch.rand(block, generator=self.generator).tolist()[::-1]
        return self._uniforms.pop()


def rows_for(request: Any, spec: SampleSpec, eos_token_ids: tuple[int, ...]) -> list[SampleRow]:
    """The ``num_samples`` rows of a request; sample ``i`` draws from generator seed (seed, i)."""
    stop_ids = eos_token_ids if spec.stop_token_ids is None else spec.stop_token_ids
    base_seed = spec.seed if spec.seed is not None else random.SystemRandom().randrange(2**62)
    return [
        SampleRow(
            request=request,
            max_tokens=spec.max_tokens,
            temperature=spec.temperature,
            top_k=spec.top_k,
            top_p=spec.top_p,
            stop_ids=frozenset(stop_ids),
            stop_strings=tuple(spec.stop_strings),
            generator=torch.Generator().manual_seed((base_seed * _SEED_STRIDE + sample) % (2**63)),
        )
        for sample in range(spec.num_samples)
    ]


def record_token(row: SampleRow, token: int, logprob: float, tokenizer: Any) -> bool:
    """Appends a sampled token to its row; True when the row has finished (stop id, stop string or budget)."""
    row.tokens.append(token)
    row.logprobs.append(logprob)
    row.stop_reason = _stop_reason(row, token, tokenizer)
    return row.stop_reason is not None


def _stop_reason(row: SampleRow, token: int, tokenizer: Any) -> str | None:
    if token in row.stop_ids:
        return "stop"
    if row.stop_strings:
        window = max(len(s) for s in row.stop_strings) + 8
        text = tokenizer.decode(row.tokens[-window:])
        if any(stop in text for stop in row.stop_strings):
            return "stop"
    if len(row.tokens) >= row.max_tokens:
        return "length"
    return None


def choose_tokens(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples one token per row; returns (tokens, their logprobs under the temperature-scaled distribution).

    Overwrites ``logits`` (float32 [rows, vocab], the caller's own): this runs for every row at every
    decode step over the 49k vocabulary, and a fresh [rows × vocab] buffer costs a page-faulting
    allocation on top of its pass (100 MB at 512 rows). Without top-k/top-p it allocates none: max,
    subtract, exp and sum in place, then
    :func:`_inverse_cdf`, which cumulates one block per row instead of the whole vocabulary. One uniform
    per row from the row's own generator.
    """
    temperatures = torch.tensor([row.temperature if row.temperature > 0 else 1.0 for row in rows])
    if not bool((temperatures == 1).all()):
        logits.div_(temperatures[:, None])
    shifted = logits.sub_(logits.amax(dim=-1, keepdim=True))  # <= 0, the largest exactly 0
    greedy = [i for i, row in enumerate(rows) if row.temperature == 0]
    greedy_tokens = shifted[greedy].argmax(dim=-1) if greedy else None
    uniforms = torch.tensor([row.next_uniform() for row in rows])
    if _filters(rows, logits.shape[-1]):
        log_totals = torch.logsumexp(shifted, dim=-1, keepdim=True)
        tokens = _inverse_cdf(exp_(_filter_top_k_top_p(shifted - log_totals, rows)), uniforms)
        if greedy:
            tokens[greedy] = greedy_tokens
        return tokens, (shifted.gather(-1, tokens[:, None]) - log_totals).squeeze(-1)
    weights = exp_(shifted)  # logits now hold exp(logit - max): the largest is exactly 1
    log_totals = weights.sum(dim=-1, keepdim=True).log_()
    tokens = _inverse_cdf(weights, uniforms)
    if greedy:
        tokens[greedy] = greedy_tokens
    # log(exp(x)) gives x back to ~1e-7; a drawn token's weight is never 0 (zero-width steps are never hit).
    return tokens, (weights.gather(-1, tokens[:, None]).log_() - log_totals).squeeze(-1)


_CDF_BLOCK = 1024


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """For each row the first index whose cumulative weight exceeds ``uniform × total``, from block sums:
    the cumulative sum of the [rows × vocab] weights would be one more full pass and buffer; block sums
    find the block, and only that block is cumulated. Weights are unnormalised and non-negative."""
    rows, vocab = weights.shape
    full = vocab // _CDF_BLOCK * _CDF_BLOCK
    sums = [weights[:, :full].reshape(rows, -1, _CDF_BLOCK).sum(dim=-1)] if full else []
    if full < vocab:
        sums.append(weights[:, full:].sum(dim=-1, keepdim=True))
    block_sums = torch.cat(sums, dim=-1)
    block_cdf = block_sums.cumsum(dim=-1)
    targets = uniforms * block_cdf[:, -1]
    # A target rounded up to the total would pick no block: take the last block of non-zero weight.
    block = torch.minimum(
        torch.searchsorted(block_cdf, targets[:, None], right=True).squeeze(-1), _last_positive(block_sums)
    )
    before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0)[:, None]).squeeze(-1), 0.0)
    columns = block[:, None] * _CDF_BLOCK + torch.arange(_CDF_BLOCK)[None, :]
    inside = columns < vocab
    local = weights.gather(-1, columns.clamp(max=vocab - 1)).masked_fill_(~inside, 0.0)
    last = _last_positive(local)  # the block's sum and its cumulation round differently: stay inside it
    offset = torch.searchsorted(local.cumsum_(dim=-1), (targets - before)[:, None], right=True).squeeze(-1)
    return block * _CDF_BLOCK + torch.minimum(offset, last)


def _last_positive(values: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the last positive entry (0 if none)."""
    return (values > 0).int().cumsum(dim=-1).argmax(dim=-1)


def _filters(rows: list[SampleRow], vocab: int) -> bool:
    """Whether any row limits its choice with top-k or top-p."""
    return any(0 < row.top_k < vocab or row.top_p < 1 for row in rows)


def _filter_top_k_top_p(log_probs: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    vocab = log_probs.shape[-1]
    top_k = torch.tensor([row.top_k if 0 < row.top_k < vocab else vocab for row in rows])
    top_p = torch.tensor([row.top_p for row in rows])
    sorted_logprobs, order = log_probs.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab)[None, :]
    probs_before = sorted_logprobs.exp().cumsum(dim=-1) - sorted_logprobs.exp()
    drop_sorted = (ranks >= top_k[:, None]) | ((probs_before >= top_p[:, None]) & (ranks > 0))
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return log_probs.masked_fill(drop, float("-inf"))
