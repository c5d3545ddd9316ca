"""The trainer's forward, one micro-batch at a time; a prompt shared by several datums runs once.

Shared: a GRPO group's G samples, a DPO pair; everything else runs as length-sorted, right-padded rows.

An RL batch holds each prompt G times (one datum per sample) and a DPO batch twice (chosen, rejected).
A causal model's hidden states over a prompt do not depend on what follows it, so the trainer runs the
shared prefix once per group — its keys and values, with their autograd graph, become the cache the
members' own tokens attend to — and the gradients every member sends back into the prefix are summed by
autograd, as they would be across separate rows. Same function, same gradients; ``(G − 1) × prefix``
fewer tokens through the model. The logprobs of prompt
positions, identical across the group, are computed once too.

:func:`group_by_prefix` picks the groups: datums sorted by their keys, so those with a common prefix
are neighbours, then the partition of that order into runs that saves the most tokens, a run sharing the
longest prefix common to all its members (at least :data:`MIN_SHARED_TOKENS`, and each member keeps at
least one token of its own). It compares :func:`sharing_keys`, not bare tokens: a shared row's target must be
every member's target too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from localtinker.engine.shared_prefix_attention import MAX_OWN_TOKENS, SharedPrefixCache

MIN_SHARED_TOKENS = 16  # below this a second forward and a masked attention cost more than they save
MAX_GROUP = 64  # members considered per run (keeps the partition search linear in the batch)


@dataclass(frozen=True)
class PrefixGroup:
    members: tuple[int, ...]  # datum indices
    shared: int  # leading tokens common to every member, run once (0: none, members run alone)


@dataclass
class TokenRows:
    """Hidden states of the positions whose logprobs a micro-batch needs, each computed once.

    ``datum_rows[i]`` indexes ``hidden``/``targets`` for datum i's positions, in order: a shared
    prompt position appears in every member's index and is one row of ``hidden``."""

    hidden: torch.Tensor  # [rows, hidden size]
    targets: torch.Tensor  # int64 [rows]
    datum_rows: dict[int, torch.Tensor]  # datum index -> int64 [T_i] rows of its positions


def token_rows(
    decoder: torch.nn.Module, tokens: list[torch.Tensor], targets: list[torch.Tensor], budget: int, share: bool = True,
    shared_budget: int | None = None,
) -> Iterator[TokenRows]:
    """The hidden states of every datum position, one micro-batch of at most ``budget`` padded tokens at a
    time (``shared_budget``, default ``budget``, for groups): datums that share a prompt
    (:func:`group_by_prefix`) run it once per group, the others as rows. ``share=False`` runs every datum
    as its own row."""
    keys = sharing_keys(tokens, targets) if share else tokens
    groups = group_by_prefix(keys) if share else [PrefixGroup((i,), 0) for i in range(len(tokens))]
    batches, left = shared_microbatches([g for g in groups if g.shared], keys, shared_budget or budget)
    alone = sorted(left + [index for group in groups if not group.shared for index in group.members])
    for positions in _plain_microbatches([tokens[i].shape[0] for i in alone], budget):
        yield plain_rows(decoder, [alone[k] for k in positions], tokens, targets)
    for batch in batches:
        yield shared_rows(decoder, batch, tokens, targets, keys)


def _plain_microbatches(lengths: list[int], budget: int) -> list[list[int]]:
    """Positions in ``lengths`` per micro-batch of at most ``budget`` padded tokens. Rows go in order of
    length, so a micro-batch pads little: chat data mixes 20- and 500-token rows, and padding each
    call's rows to its longest would waste half the compute (bench/bench_engine_sft_varlen.py). A row
    longer than the budget runs alone."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if current and max(longest, lengths[index]) * (len(current) + 1) > budget:
            batches.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, lengths[index])
    if current:
        batches.append(current)
    return batches


def sharing_keys(tokens: list[torch.Tensor], targets: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per datum position *j*: its token and the target of position *j − 1*, as one int64.

    Datums whose keys agree on their first *n* positions have the same first *n* tokens and the same first
    *n − 1* targets: exactly what running those *n* positions once needs (the last one's hidden state is shared,
    its target is each member's own). With the usual shifted targets the keys agree where the tokens do;
    datums with equal tokens but targets of their own share only as far as their targets agree."""
    keys = []
    for datum_tokens, datum_targets in zip(tokens, targets):
        previous = torch.zeros_like(datum_tokens, dtype=torch.int64)
        previous[1:] = datum_targets[:-1].to(torch.int64) + 1
        keys.append(datum_tokens.to(torch.int64) * (1 << 32) + previous)
    return keys


def group_by_prefix(tokens: list[torch.Tensor]) -> list[PrefixGroup]:
    """Partitions datums into groups that share a prefix (singletons share nothing), saving the most tokens.

    Two levels: datums sharing a system prompt in front of different problems are first one run (saving
    the system prompt), then split into the problems' groups where each of its members is in one that
    shares ≥ :data:`MIN_SHARED_TOKENS` more (each problem's G samples); :func:`shared_rows` runs the
    system prompt once per micro-batch as their common root. A run where some member would be left on its
    own stays whole (that member would lose the system prompt's sharing)."""
    arrays = [t.numpy() for t in tokens]
    order = sorted(range(len(arrays)), key=lambda i: tuple(arrays[i].tolist()))
    # common[k]: tokens shared by order[k] and order[k + 1], leaving each at least one of its own
    common = [_common_prefix(arrays[a], arrays[b]) for a, b in zip(order, order[1:])]
    groups = []
    for start, end, shared in _best_runs(common, 0, MIN_SHARED_TOKENS):
        sub_runs = _best_runs(common[start : end - 1], shared, MIN_SHARED_TOKENS) if end - start > 1 else []
        if len(sub_runs) > 1 and all(b - a > 1 for a, b, _ in sub_runs):
            # Every member in a sub-group that shares more: those are the groups, the run's prefix their root.
            groups += [PrefixGroup(tuple(sorted(order[start + a : start + b])), c) for a, b, c in sub_runs]
        else:
            groups.append(PrefixGroup(tuple(sorted(order[start:end])), shared))  # a singleton: shared 0
    return groups


def _best_runs(common: list[int], floor: int, minimum: int) -> list[tuple[int, int, int]]:
    """The partition of ``len(common) + 1`` datums (in sorted order, ``common`` between neighbours) into
    runs ``(start, end, shared)`` that maximises Σ (members − 1) × (shared − floor), where a run's
    ``shared`` is the least ``common`` inside it and counts only when ``shared − floor ≥ minimum``."""
    count = len(common) + 1
    best = [0] * (count + 1)  # saving of the best partition of the first j datums
    choice = [0] * (count + 1)  # where its last run starts
    for end in range(1, count + 1):
        best[end], choice[end] = best[end - 1], end - 1  # datum end - 1 alone
        shared = None
        for start in range(end - 2, max(-1, end - 1 - MAX_GROUP), -1):
            shared = common[start] if shared is None else min(shared, common[start])
            if shared - floor < minimum:
                break
            saved = best[start] + (end - 1 - start) * (shared - floor)
            if saved > best[end]:
                best[end], choice[end] = saved, start
    runs = []
    end = count
    while end > 0:
        start = choice[end]
        runs.append((start, end, min(common[start : end - 1]) if end - start > 1 else floor))
        end = start
    return runs[::-1]


def _common_prefix(a: np.ndarray, b: np.ndarray, limit: int | None = None) -> int:
    """Leading tokens ``a`` and ``b`` share, at most ``limit`` (default: leaving each one of its own)."""
    limit = min(len(a), len(b)) - 1 if limit is None else limit
    if limit <= 0:
        return 0
    differ = np.flatnonzero(a[:limit] != b[:limit])
    return int(differ[0]) if len(differ) else limit


def plain_rows(
    decoder: torch.nn.Module, indices: list[int], tokens: list[torch.Tensor], targets: list[torch.Tensor]
) -> TokenRows:
    """The datums ``indices`` each as its own right-padded row (no mask needed: causal attention never
    lets a real token see the pads after it)."""
    lengths = [tokens[i].shape[0] for i in indices]
    input_ids = torch.zeros((len(indices), max(lengths)), dtype=torch.long)
    for row, index in enumerate(indices):
        input_ids[row, : lengths[row]] = tokens[index]
    hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state
    real = torch.arange(input_ids.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    datum_rows = {index: torch.arange(start, start + length) for index, start, length in zip(indices, starts, lengths)}
    return TokenRows(hidden[real], torch.cat([targets[i] for i in indices]), datum_rows)


def shared_microbatches(
    groups: list[PrefixGroup], tokens: list[torch.Tensor], budget: int
) -> tuple[list[list[PrefixGroup]], list[int]]:
    """Sharing groups packed into micro-batches of at most ``budget`` padded tokens (prefix rows + own
    rows, a root common to the micro-batch's prefixes counted once), and the datums left to run as plain rows.

    A group is cut into chunks in order of length, each running the prefix once: a chunk takes members
    while ``shared + members × longest own part`` fits the budget. A prefix longer than the budget still
    runs with two members if their own parts are no longer than it (memory: one datum plus one own part,
    no more). A member left alone in its chunk would gain nothing from its prefix: it runs as a plain row.
    """
    lengths = [t.shape[0] for t in tokens]
    chunks: list[PrefixGroup] = []
    alone: list[int] = []
    for group in groups:
        for members in _chunk_members(group, lengths, budget):
            if len(members) >= 2:
                chunks.append(PrefixGroup(tuple(members), group.shared))
            else:
                alone += members
    chunks.sort(key=lambda chunk: max(lengths[i] for i in chunk.members) - chunk.shared)
    batches: list[list[PrefixGroup]] = []
    current: list[PrefixGroup] = []
    for chunk in chunks:
        candidate = current + [chunk]
        if current and _padded_tokens(candidate, tokens) > budget:
            batches.append(current)
            candidate = [chunk]
        current = candidate
    if current:
        batches.append(current)
    return batches, alone


def _padded_tokens(chunks: list[PrefixGroup], tokens: list[torch.Tensor]) -> int:
    """Token positions :func:`shared_rows` runs for ``chunks``: the root once, prefixes and own parts padded."""
    root = common_root(chunks, tokens)
    prefixes = root + len(chunks) * (max(c.shared for c in chunks) - root)
    own = max(tokens[i].shape[0] - c.shared for c in chunks for i in c.members)
    return prefixes + sum(len(c.members) for c in chunks) * own


def _chunk_members(group: PrefixGroup, lengths: list[int], budget: int) -> list[list[int]]:
    chunks: list[list[int]] = [[]]
    for index in sorted(group.members, key=lambda i: lengths[i]):
        chunk = chunks[-1]
        own = lengths[index] - group.shared  # the longest so far: members come in order of length
        fits = group.shared + (len(chunk) + 1) * own <= budget or (len(chunk) < 2 and own <= group.shared)
        if chunk and not fits:
            chunks.append([])
        chunks[-1].append(index)
    return chunks


def shared_rows(
    decoder: torch.nn.Module, groups: list[PrefixGroup], tokens: list[torch.Tensor], targets: list[torch.Tensor],
    keys: list[torch.Tensor],
) -> TokenRows:
    """Runs each group's prefix once (left-padded to the longest, masked), then every member's own tokens
    (right-padded) attending to its group's prefix keys and values; ``tokens``/``targets``/``keys`` (the
    datums' :func:`sharing_keys`) are indexed by the members' datum indices. A root that every group's prefix
    starts with (a system prompt or few-shot examples in front of different problems, :func:`common_root`) runs
    once for the whole micro-batch, and the group prefixes attend to it in turn."""
    root = common_root(groups, keys)
    root_ids = tokens[groups[0].members[0]][:root]
    width = max(group.shared for group in groups) - root  # group prefixes after the root
    prefix_ids = torch.zeros((len(groups), width), dtype=torch.long)
    prefix_mask = torch.zeros((len(groups), root + width), dtype=torch.long)
    prefix_mask[:, :root] = 1
    for row, group in enumerate(groups):
        prefix_ids[row, width - (group.shared - root) :] = tokens[group.members[0]][root : group.shared]
        prefix_mask[row, root + width - (group.shared - root) :] = 1
    cache = DynamicCache(config=decoder.config)
    root_hidden = None
    if root:
        root_hidden = decoder(
            input_ids=root_ids[None], position_ids=torch.arange(root)[None], past_key_values=cache, use_cache=True
        ).last_hidden_state[0]
        cache = _PrefixCache(
            [(layer.keys.expand(len(groups), -1, -1, -1), layer.values.expand(len(groups), -1, -1, -1)) for layer in cache.layers]
        )
    prefix_hidden = decoder(
        input_ids=prefix_ids,
        attention_mask=prefix_mask,
        position_ids=(prefix_mask.cumsum(-1) - 1).clamp(min=0)[:, root:],
        past_key_values=cache,
        use_cache=True,
    ).last_hidden_state

    members = [(row, index) for row, group in enumerate(groups) for index in group.members]
    member_group = torch.tensor([row for row, _ in members])
    own = [tokens[index][groups[row].shared :] for row, index in members]
    own_width = max(t.shape[0] for t in own)
    own_ids = torch.zeros((len(members), own_width), dtype=torch.long)
    for row, own_tokens in enumerate(own):
        own_ids[row, : own_tokens.shape[0]] = own_tokens
    starts = torch.tensor([groups[row].shared for row, _ in members])
    if own_width <= MAX_OWN_TOKENS:  # each group's prompt read once per layer (shared_prefix_attention.py)
        member_cache = SharedPrefixCache([(layer.keys, layer.values) for layer in cache.layers], prefix_mask.bool(),
                                         [len(group.members) for group in groups])
    else:
        member_cache = _PrefixCache([(layer.keys[member_group], layer.values[member_group]) for layer in cache.layers])
    own_hidden = decoder(
        input_ids=own_ids,
        attention_mask=torch.cat([prefix_mask[member_group], torch.ones_like(own_ids)], dim=1),
        position_ids=starts[:, None] + torch.arange(own_width)[None, :],
        past_key_values=member_cache,
        use_cache=True,
    ).last_hidden_state

    # Rows: the root's positions but its last, once (the same targets everywhere); per group, the root's last
    # position (whose target is the group's next token) and its prefix positions but the last, once; per
    # member, its group's last prefix position (whose target is its first own token) and its own positions.
    pieces: list[torch.Tensor] = []
    row_targets: list[torch.Tensor] = []
    if root:
        pieces.append(root_hidden[: root - 1])
        row_targets.append(targets[groups[0].members[0]][: root - 1])
    root_rows = torch.arange(max(root - 1, 0))
    count = root_rows.shape[0]
    group_rows: list[torch.Tensor] = []
    for row, group in enumerate(groups):
        if root:
            pieces.append(root_hidden[root - 1 :])
        pieces.append(prefix_hidden[row, width - (group.shared - root) : width - 1])
        row_targets.append(targets[group.members[0]][max(root - 1, 0) : group.shared - 1])
        length = group.shared - 1 - max(root - 1, 0)
        group_rows.append(torch.cat([root_rows, torch.arange(count, count + length)]))
        count += length
    datum_rows: dict[int, torch.Tensor] = {}
    for member_row, (row, index) in enumerate(members):
        shared = groups[row].shared
        own_length = tokens[index].shape[0] - shared
        pieces += [prefix_hidden[row, width - 1 :], own_hidden[member_row, :own_length]]
        row_targets.append(targets[index][shared - 1 :])
        datum_rows[index] = torch.cat([group_rows[row], torch.arange(count, count + 1 + own_length)])
        count += 1 + own_length
    return TokenRows(torch.cat(pieces), torch.cat(row_targets), datum_rows)


def common_root(groups: list[PrefixGroup], tokens: Sequence[torch.Tensor]) -> int:
    """Positions every group's prefix starts with, leaving each group at least one prefix token of its own;
    0 for a single group or fewer than :data:`MIN_SHARED_TOKENS`. ``tokens``: by datum index, the datums'
    :func:`sharing_keys` (or tokens, where the targets are known to be the shifted tokens)."""
    if len(groups) < 2:
        return 0
    first = tokens[groups[0].members[0]].numpy()
    root = min(group.shared for group in groups) - 1
    for group in groups[1:]:
        root = _common_prefix(first, tokens[group.members[0]].numpy(), root)
    return root if root >= MIN_SHARED_TOKENS else 0


class _PrefixLayer(DynamicLayer):
    """A cache layer that starts out holding given keys/values (with their autograd graph). Not
    ``kv_rows.ColumnBufferLayer``: that one writes new columns in place, which autograd cannot follow."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values


class _PrefixCache(DynamicCache):
    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        Cache.__init__(self, layers=[_PrefixLayer(keys, values) for keys, values in layers])
