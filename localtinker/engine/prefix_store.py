"""Keys and values of recent prompts and conversations, kept for the requests that extend them.

A multi-turn episode (a game, a tool loop, a tinker-cookbook ``MessageEnv``) sends at each turn the whole
conversation so far: the previous turn's prompt, its completion and the new observation. Without this
store every turn prefilled the whole conversation again, so a turn cost grew with the conversation
(quadratically over an episode) although only the observation is new. The decode batch keeps here:

- every prompt it prefills from nothing (a copy of its keys and values, gathered per prefill chunk);
- the prompt and completion of each sample of a request that itself *extended* a kept sequence (a
  continuation), when that sample finishes. Completions of other requests are not kept: copying every
  sample's keys would tax single-turn sampling (a GRPO step's 512 samples) for nothing. A continuation's
  prompt alone is not kept either: its samples, which extend it, are.

So a conversation's second turn reuses its first prompt, and every later turn everything but the last
completion's final token and the new observation. A new prompt reuses the longest kept prefix of the
same weights (found through chained hashes of 16-token blocks, then extended token by token among the
sequences that hold its last matching block); at least one prompt token is always prefilled, for the
logits of the first sampled token.

Memory: a budget of stored tokens (``LOCALTINKER_PREFIX_CACHE_TOKENS``, default 32768, ~1.5 GB of float32
keys and values on SmolLM2-135M; 0 turns the store off), in two parts, least recently used first out of
each. Sequences that have *proven* useful (a continuation's samples, or a kept prompt that a later
request extended) may use all of it; prompts kept on the chance that a next turn comes (*unproven*) at
most a quarter, and they leave first. So single-turn sampling, whose prompts never come back, holds at
most a quarter of the budget (the prompts of its last few steps) instead of all of it. Weights keys name fixed weights (a
checkpoint path and its creation time, or an ephemeral snapshot), so a kept sequence is never reused
under other weights: a later sampler has another key, and its predecessor's sequences age out.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

BLOCK_TOKENS = 16  # prefixes are indexed per block of this many tokens; shorter reuse is not worth a lookup
DEFAULT_BUDGET_TOKENS = 32768
UNPROVEN_SHARE = 0.25  # of the budget, at most, for prompts no request has extended yet
ENV_BUDGET = "LOCALTINKER_PREFIX_CACHE_TOKENS"


def budget_from_env() -> int:
    """Tokens the store may hold: ``$LOCALTINKER_PREFIX_CACHE_TOKENS`` or the default; 0 disables it."""
    raw = os.environ.get(ENV_BUDGET, "").strip()
    if not raw:
        return DEFAULT_BUDGET_TOKENS
    try:
        budget = int(raw)
    except ValueError:
        budget = -1
    if budget < 0:
        raise ValueError(f"{ENV_BUDGET}={raw!r}: give a number of tokens >= 0 (0 turns the prefix store off)")
    return budget


@dataclass(eq=False)
class KeptSequence:
    """Tokens whose keys and values were computed by one set of weights: ``[layers, key heads, tokens, dim]``
    each (one tensor per sequence, not one per layer: a GRPO admission keeps 64 prompts at once)."""

    weights: str
    tokens: tuple[int, ...]
    keys: torch.Tensor
    values: torch.Tensor
    block_hashes: list[int] = field(default_factory=list)
    proven: bool = False  # a continuation's sample, or extended by a later request


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy of it when it is a view of a larger buffer. A kept prompt is a view of its prefill
    chunk's one gather (cheap while its neighbours are kept too); a sequence that may outlive them (a proven
    one) must not keep that whole buffer alive uncounted."""
    return tensor if tensor.untyped_storage().nbytes() <= tensor.nbytes else tensor.clone()


def block_hashes(tokens: Sequence[int], limit: int | None = None) -> list[int]:
    """Chained hashes of the first ``limit`` tokens' whole blocks: entry ``k`` names ``tokens[:16 (k + 1)]``."""
    count = len(tokens) if limit is None else min(limit, len(tokens))
    hashes, running = [], 0
    for start in range(0, count - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        running = hash((running, tuple(tokens[start : start + BLOCK_TOKENS])))
        hashes.append(running)
    return hashes


class PrefixStore:
    """Kept sequences of every weights, in two least-recently-used orders; see the module docstring."""

    def __init__(self, budget_tokens: int | None = None) -> None:
        self.budget_tokens = budget_from_env() if budget_tokens is None else budget_tokens
        # id(sequence) -> sequence, least recently used first: proven ones, and unproven ones
        self._orders: dict[bool, OrderedDict[int, KeptSequence]] = {True: OrderedDict(), False: OrderedDict()}
        # (weights, block hash) -> {id: sequence} holding that block / whose last whole block it is
        self._holding: dict[tuple[str, int], dict[int, KeptSequence]] = {}
        self._ending: dict[tuple[str, int], dict[int, KeptSequence]] = {}
        self.tokens = 0
        self.unproven_tokens = 0

    @property
    def enabled(self) -> bool:
        return self.budget_tokens > 0

    def __len__(self) -> int:
        return len(self._orders[True]) + len(self._orders[False])

    def longest_prefix(self, weights: str, prompt: Sequence[int]) -> tuple[KeptSequence, int] | None:
        """(kept sequence, tokens of ``prompt`` it holds) for the longest kept prefix of ``prompt`` under
        ``weights``, at least one block and leaving at least the last prompt token to prefill; else None.
        The sequence found is now the most recently used, and proven."""
        if not self.enabled or len(prompt) <= BLOCK_TOKENS:
            return None
        limit = len(prompt) - 1
        hashes = block_hashes(prompt, limit=limit)
        for blocks in range(len(hashes), 0, -1):
            whole = blocks * BLOCK_TOKENS
            best, best_length = None, 0
            for kept in self._holding.get((weights, hashes[blocks - 1]), {}).values():
                if kept.tokens[:whole] != tuple(prompt[:whole]):  # a hash collision
                    continue
                length, end = whole, min(len(kept.tokens), limit)
                while length < end and kept.tokens[length] == prompt[length]:
                    length += 1
                if length >= best_length:  # ties: the most recently kept
                    best, best_length = kept, length
            if best is not None:
                self._use(best, proven=True)
                return best, best_length
        return None

    def keep(self, weights: str, tokens: Sequence[int], keys: torch.Tensor, values: torch.Tensor,
             proven: bool = False) -> None:
        """Keeps ``tokens`` with their keys and values ``[layers, key heads, len(tokens), dim]``; ``proven``
        for a continuation's sample. Sequences shorter than a block or longer than their part of the budget
        are not kept; kept ones that are a prefix of ``tokens`` leave (the new one serves every lookup they
        served, and is proven if one of them was)."""
        tokens = tuple(tokens)
        if not self.enabled or len(tokens) < BLOCK_TOKENS or len(tokens) > self._limit(proven):
            return
        hashes = block_hashes(tokens)
        for block, block_hash in enumerate(hashes):
            for held in list(self._ending.get((weights, block_hash), {}).values()):
                whole = (block + 1) * BLOCK_TOKENS  # ``held`` and ``tokens`` agree up to here (same chained hash)
                if len(held.tokens) <= len(tokens) and held.tokens[whole:] == tokens[whole : len(held.tokens)]:
                    if held.tokens == tokens:
                        self._use(held, proven)
                        return
                    proven = proven or held.proven
                    self._forget(held)
        if proven:
            keys, values = own_storage(keys), own_storage(values)
        kept = KeptSequence(weights, tokens, keys, values, hashes, proven)
        self._orders[proven][id(kept)] = kept
        for block_hash in hashes:
            self._holding.setdefault((weights, block_hash), {})[id(kept)] = kept
        self._ending.setdefault((weights, hashes[-1]), {})[id(kept)] = kept
        self.tokens += len(tokens)
        self.unproven_tokens += 0 if proven else len(tokens)
        self._fit()

    def _limit(self, proven: bool) -> float:
        return self.budget_tokens if proven else UNPROVEN_SHARE * self.budget_tokens

    def _use(self, kept: KeptSequence, proven: bool) -> None:
        """Makes ``kept`` the most recently used of its order (of the proven ones, if ``proven``)."""
        if proven and not kept.proven:
            del self._orders[False][id(kept)]
            kept.proven = True
            kept.keys, kept.values = own_storage(kept.keys), own_storage(kept.values)
            self._orders[True][id(kept)] = kept
            self.unproven_tokens -= len(kept.tokens)
        self._orders[kept.proven].move_to_end(id(kept))

    def _fit(self) -> None:
        """Unproven sequences within their share, then everything within the budget, least recently used
        out first (unproven ones before proven ones)."""
        while self.unproven_tokens > self._limit(False):
            self._forget(next(iter(self._orders[False].values())))
        while self.tokens > self.budget_tokens:
            order = self._orders[False] or self._orders[True]
            self._forget(next(iter(order.values())))

    def _forget(self, kept: KeptSequence) -> None:
        if self._orders[kept.proven].pop(id(kept), None) is None:
            return
        self.tokens -= len(kept.tokens)
        self.unproven_tokens -= 0 if kept.proven else len(kept.tokens)
        entries = [(self._holding, block_hash) for block_hash in kept.block_hashes]
        for index, block_hash in [*entries, (self._ending, kept.block_hashes[-1])]:
            holders = index.get((kept.weights, block_hash))
            if holders is not None:
                holders.pop(id(kept), None)
                if not holders:
                    del index[(kept.weights, block_hash)]
