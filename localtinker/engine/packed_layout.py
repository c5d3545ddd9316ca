"""Packed micro-batches in which datums that share a prompt run it once: the tokens' order and what each
token attends to.

An RL batch holds each prompt G times (one datum per sample) and a DPO batch twice. packed_rows.py lays the
datums end to end, each attending to itself, so a GRPO step of 16 prompts × 8 samples runs every prompt 8 times
through every projection and through the unembedding. Here a group's prefix is laid once, then each member's
own tokens:

    [prefix of group 1][own 1.1][own 1.2]…[prefix of group 2][own 2.1]…[a datum alone]…

Attention runs over *segments*: a query segment and the key rows it reads. A prefix attends to itself; a
member's own tokens attend to their group's prefix rows and then to themselves (causal, aligned at the end:
its first own token sees the whole prefix); a datum alone attends to itself. Where every group of a
micro-batch starts with the same tokens (a system prompt or few-shot examples in front of different problems),
that *root* is laid once, first, and each group's prefix segment reads it before itself, as its members do.

The flash varlen kernel takes query and key segments of different lengths (``cu_seq_q`` ≠ ``cu_seq_k``), with
the keys and values gathered into segment order first — a copy of ``[tokens, kv heads, head dim]`` per layer,
small beside a layer's products. Autograd sums the members' gradients into the prefix rows through that gather.

Which datums share what comes from prefix_sharing.py (:func:`~localtinker.engine.prefix_sharing.sharing_keys`):
the positions whose token *and* target every member has in common run once, so a prefix stops one position
before the members' tokens differ (the prompt's last token, whose target is each sample's first token, is each
member's first own token). Every packed row then has one target, and each datum's rows are its positions in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from localtinker.engine.prefix_sharing import PrefixGroup, common_root, group_by_prefix, sharing_keys


@dataclass(frozen=True)
class PackedLayout:
    """Attention segments of a packed micro-batch: query segment *i* is packed rows ``cu_q[i]:cu_q[i+1]``, and
    reads key rows ``cu_k[i]:cu_k[i+1]`` of the keys gathered by ``key_rows`` (None: the packed rows themselves,
    ``cu_k`` = ``cu_q``). Bounds on the device and their lengths on the host."""

    cu_q: torch.Tensor  # int32 [segments + 1]
    cu_k: torch.Tensor  # int32 [segments + 1]
    q_lengths: tuple[int, ...]
    k_lengths: tuple[int, ...]
    key_rows: torch.Tensor | None = None  # int64 [Σ k_lengths]: packed rows, in segment order

    @property
    def max_q(self) -> int:
        return max(self.q_lengths)

    @property
    def max_k(self) -> int:
        return max(self.k_lengths)

    @property
    def shared(self) -> bool:
        return self.key_rows is not None

    def padded(self, tokens: int, total: int) -> PackedLayout:
        """This layout over ``tokens`` packed rows, followed by ``total − tokens`` rows of padding that attend to
        themselves only (a CUDA graph serves a bucket of token counts, packed_layers.py)."""
        pad = total - tokens
        if pad <= 0:
            return self
        key_rows = self.key_rows
        if key_rows is not None:
            key_rows = torch.cat([key_rows, torch.arange(tokens, total, device=key_rows.device)])
        return PackedLayout(torch.cat([self.cu_q, self.cu_q[-1:] + pad]), torch.cat([self.cu_k, self.cu_k[-1:] + pad]),
                            (*self.q_lengths, pad), (*self.k_lengths, pad), key_rows)

    @classmethod
    def rows(cls, lengths: list[int], device: torch.device) -> PackedLayout:
        """Datums end to end, each attending to itself."""
        cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32).to(device, non_blocking=True)
        return cls(cu, cu, tuple(lengths), tuple(lengths))


@dataclass
class PackedBatch:
    """One micro-batch laid out for the model: token ids and positions in packed order, each packed row's
    target, each datum's rows (its positions, in order), and the attention segments."""

    input_ids: torch.Tensor  # int64 [tokens], on the host
    position_ids: torch.Tensor  # int64 [tokens], on the host
    targets: torch.Tensor  # int64 [tokens], on the host
    datum_rows: dict[int, torch.Tensor]  # datum index -> int64 rows, on the host
    q_lengths: list[int]
    k_segments: list[list[tuple[int, int]]]  # per query segment: the (start, length) ranges of packed rows it reads

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def layout(self, device: torch.device) -> PackedLayout:
        if all(len(ranges) == 1 for ranges in self.k_segments):
            return PackedLayout.rows(self.q_lengths, device)
        k_lengths = [sum(length for _, length in ranges) for ranges in self.k_segments]
        rows = np.concatenate([np.arange(start, start + length)
                               for ranges in self.k_segments for start, length in ranges])
        cu_q = torch.tensor([0, *np.cumsum(self.q_lengths).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *np.cumsum(k_lengths).tolist()], dtype=torch.int32)
        return PackedLayout(cu_q.to(device, non_blocking=True), cu_k.to(device, non_blocking=True),
                            tuple(self.q_lengths), tuple(k_lengths),
                            torch.from_numpy(rows).to(device, non_blocking=True))


class _Builder:
    """Lays out one micro-batch, unit by unit."""

    def __init__(self, tokens: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        self.tokens, self.targets = tokens, targets
        self.ids: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []
        self.row_targets: list[torch.Tensor] = []
        self.datum_rows: dict[int, torch.Tensor] = {}
        self.q_lengths: list[int] = []
        self.k_segments: list[list[tuple[int, int]]] = []
        self.used = 0

    def _lay(self, index: int, start: int, end: int | None, reads: list[tuple[int, int]]) -> tuple[int, int]:
        """Datum ``index``'s positions ``start:end`` as one query segment that reads ``reads`` and then itself."""
        ids = self.tokens[index][start:end]
        first, length = self.used, int(ids.shape[0])
        self.ids.append(ids)
        self.positions.append(torch.arange(start, start + length))
        self.row_targets.append(self.targets[index][start:end])
        self.q_lengths.append(length)
        self.k_segments.append([*reads, (first, length)])
        self.used += length
        return first, length

    def alone(self, index: int) -> None:
        self.datum_rows[index] = _rows([self._lay(index, 0, None, [])])

    def root(self, index: int, length: int) -> tuple[int, int]:
        """The first ``length`` positions of datum ``index``, which every group of the micro-batch starts with."""
        return self._lay(index, 0, length, [])

    def group(self, members: list[int], prefix: int, root: tuple[int, int] | None = None) -> None:
        """``members`` after their common ``prefix`` positions, laid once (after the micro-batch's ``root``)."""
        above = [] if root is None else [root]
        start = 0 if root is None else root[1]
        prefix_range = self._lay(members[0], start, prefix, above)
        for index in members:
            own = self._lay(index, prefix, None, [*above, prefix_range])
            self.datum_rows[index] = _rows([*above, prefix_range, own])

    def batch(self) -> PackedBatch:
        return PackedBatch(torch.cat(self.ids), torch.cat(self.positions), torch.cat(self.row_targets),
                           self.datum_rows, self.q_lengths, self.k_segments)


def segment_visibility(q_length: int, k_length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Which keys each query of a segment sees, [queries, keys]: causally, aligned at the keys' end (a query segment
    shorter than its keys is their last rows: query i sees keys ≤ i + offset), and with a sliding ``window`` none
    at or before its position − window. The attentions that take segments explicitly all mask by it."""
    offset = k_length - q_length
    visible = torch.ones((q_length, k_length), dtype=torch.bool, device=device).tril(offset)
    if window:
        visible &= ~torch.ones_like(visible).tril(offset - window)
    return visible


def _rows(ranges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([torch.arange(start, start + length) for start, length in ranges])


def packed_batches(tokens: list[torch.Tensor], targets: list[torch.Tensor], budget: int,
                   share: bool) -> list[PackedBatch]:
    """The datums in micro-batches of at most ``budget`` packed tokens (a datum longer than that runs alone).
    With ``share``, each group that shares a prompt lays its prefix once per micro-batch it reaches (a group too
    big for one is cut where the budget ends, and the next part lays the prefix again), and a root that all the
    groups of a micro-batch start with (a system prompt in front of different problems) is laid once for them."""
    keys = sharing_keys(tokens, targets) if share else None
    groups = group_by_prefix(keys) if keys is not None else [PrefixGroup((i,), 0) for i in range(len(tokens))]
    return [_lay_plan(plan, tokens, targets, keys) for plan in _plan(groups, [int(t.shape[0]) for t in tokens], budget)]


def _plan(groups: list[PrefixGroup], lengths: list[int], budget: int) -> list[list[PrefixGroup]]:
    """Micro-batches as lists of chunks: a group's members that run together (``shared`` > 0: they share it),
    or one datum alone (``shared`` 0). Counted without roots, so a micro-batch with one is under its budget."""
    plans: list[list[PrefixGroup]] = []
    current: list[PrefixGroup] = []
    used = 0

    def close(chunk: list[int], shared: int) -> None:
        if chunk:
            current.append(PrefixGroup(tuple(chunk), shared if len(chunk) > 1 else 0))

    for group in groups:
        prefix = group.shared - 1  # the positions with a common target too (module docstring)
        if len(group.members) == 1 or prefix <= 0:
            for index in group.members:
                if used and used + lengths[index] > budget:
                    plans.append(current)
                    current, used = [], 0
                current.append(PrefixGroup((index,), 0))
                used += lengths[index]
            continue
        chunk: list[int] = []
        for index in sorted(group.members, key=lambda i: lengths[i]):
            cost = lengths[index] - prefix + (0 if chunk else prefix)
            if used + cost > budget and used:
                close(chunk, group.shared)
                plans.append(current)
                current, used, chunk, cost = [], 0, [], lengths[index]
            chunk.append(index)
            used += cost
        close(chunk, group.shared)
    if current:
        plans.append(current)
    return plans


def _lay_plan(plan: list[PrefixGroup], tokens: list[torch.Tensor], targets: list[torch.Tensor],
              keys: list[torch.Tensor] | None) -> PackedBatch:
    builder = _Builder(tokens, targets)
    sharing = [chunk for chunk in plan if chunk.shared]
    # the root: positions whose token and target every group's members have in common, one before common_root's
    # end as a group's prefix stops one before its members' (the module docstring); 0 when too short to pay
    root_length = max(common_root(sharing, keys) - 1, 0) if keys is not None else 0
    root = builder.root(sharing[0].members[0], root_length) if root_length else None
    for chunk in plan:
        if chunk.shared:
            builder.group(list(chunk.members), chunk.shared - 1, root)
        else:
            builder.alone(chunk.members[0])
    return builder.batch()
