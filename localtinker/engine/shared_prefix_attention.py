"""The trainer's attention over a prompt shared by several datums: the prompt's keys read once per group.

In a shared micro-batch (prefix_sharing.py) each member's own tokens (a GRPO sample, a DPO response)
attend to its group's prompt and to themselves. Copying the prompt's keys and values into every member
and running ``scaled_dot_product_attention`` over them cost, per layer: the copy (and in the backward the
``index_put`` that sums the members' gradients back), the grouped-query expansion of those keys to every
query head (and its summing backward), and CPU flash attention with a mask, which is slow on such small
blocks: a visible share of a GRPO step's ``forward_backward`` (docs/engine-notes.md, shared prompts; bench/bench_rl_step.py).

Here, as in the sampler's decode steps (shared_prompt_kv.py), the attention is computed in two parts:

- *prefix part*: the queries of all members of a group against the group's prompt keys, one product per
  group ([members × query heads of a key head × own tokens] × prompt columns), never copying the prompt;
- *own part*: each member against its own keys, causal;

then one float32 softmax over both parts' scores (the prompt's padding masked) and the same two products
with the values. Autograd differentiates it as written, and the members' gradients reach the prompt's
keys and values through the one product. Same function as the copied-prompt attention up to float32
rounding.

It stores the attention probabilities for the backward ([members × heads × own × (prompt + own)]), so it
serves short own parts only (:data:`MAX_OWN_TOKENS`): RL completions, short DPO responses; the two paths
tie at ~48 own tokens and flash wins beyond (per-layer timings: docs/engine-notes.md). Under that bound it
also stores less than the copied-prompt path, whose flash
attention keeps every member's copy of the prompt's keys and values expanded to all query heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

MAX_OWN_TOKENS = 32  # longer own parts take the copied-prompt flash attention


@dataclass(frozen=True)
class MemberLayout:
    """Which group each member (a row of the own-token batch) belongs to. Members come group by group
    (``sizes[g]`` consecutive rows for group g), as prefix_sharing.shared_rows lays them out."""

    sizes: tuple[int, ...]

    @cached_property
    def member_group(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(len(self.sizes)), torch.tensor(self.sizes))

    @cached_property
    def buckets(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(groups [n], member rows [n, size]) per distinct group size: one batched product each."""
        starts = torch.tensor(self.sizes).cumsum(0) - torch.tensor(self.sizes)
        result = []
        for size in sorted(set(self.sizes)):
            groups = torch.tensor([g for g, s in enumerate(self.sizes) if s == size])
            result.append((groups, starts[groups, None] + torch.arange(size)))
        return result

    @cached_property
    def inverse(self) -> torch.Tensor:
        """Position in bucket order of each member."""
        return torch.argsort(torch.cat([rows.flatten() for _, rows in self.buckets]))

    def per_group(self, members: torch.Tensor, product) -> torch.Tensor:
        """``product(stacked, groups)`` over each bucket's members stacked per group, back in member order.

        ``members`` is [members, key heads, rows, columns]; a bucket's share is stacked to [n, key heads,
        size × rows, columns] and ``product`` gets it with the bucket's group indices (None: every group,
        in order). Returns [members, key heads, rows, columns′]."""
        count, heads, rows, _ = members.shape
        if len(self.buckets) == 1:
            size = self.sizes[0]
            stacked = members.reshape(len(self.sizes), size, heads, rows, -1).transpose(1, 2)
            out = product(stacked.reshape(len(self.sizes), heads, size * rows, -1), None)
            return out.reshape(len(self.sizes), heads, size, rows, -1).transpose(1, 2).reshape(count, heads, rows, -1)
        parts = []
        for groups, member_rows in self.buckets:
            n, size = member_rows.shape
            stacked = members[member_rows.flatten()].reshape(n, size, heads, rows, -1).transpose(1, 2)
            out = product(stacked.reshape(n, heads, size * rows, -1), groups)
            parts.append(out.reshape(n, heads, size, rows, -1).transpose(1, 2).reshape(n * size, heads, rows, -1))
        return torch.cat(parts)[self.inverse]


@dataclass(frozen=True)
class SharedPrefixKV:
    """What a :class:`SharedPrefixLayer` hands the attention in place of dense keys and values."""

    prefix_keys: torch.Tensor  # [groups, key heads, prompt columns, dim], with their autograd graph
    prefix_values: torch.Tensor
    prefix_mask: torch.Tensor  # bool [groups, prompt columns]: False on left padding
    layout: MemberLayout
    own_keys: torch.Tensor  # [members, key heads, own tokens, dim]
    own_values: torch.Tensor

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each member's keys and values with its group's prompt copied in (the mask transformers built
        for the call already covers them): for attention options the shared path does not implement."""
        group = self.layout.member_group
        return (torch.cat([self.prefix_keys[group], self.own_keys], dim=-2),
                torch.cat([self.prefix_values[group], self.own_values], dim=-2))


class SharedPrefixLayer(DynamicLayer):
    """One layer's group prompts; its ``update`` takes the members' own keys and values (with their graph)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, layout: MemberLayout) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values  # get_seq_length: the prompt columns, which transformers' mask counts
        self.mask, self.layout = mask, layout

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        view = SharedPrefixKV(self.keys, self.values, self.mask, self.layout, key_states, value_states)
        return view, view


class SharedPrefixCache(DynamicCache):
    """The cache of a members' forward: every layer's group prompts, read once per group."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, sizes: list[int]) -> None:
        layout = MemberLayout(tuple(sizes))
        Cache.__init__(self, layers=[SharedPrefixLayer(keys, values, mask, layout) for keys, values in layers])


def shared_prefix_attention(query: torch.Tensor, kv: SharedPrefixKV, scaling: float | None) -> torch.Tensor:
    """softmax(q·kᵀ·scaling + mask)·v over each member's group prompt and its own tokens (causal):
    [members, query heads, own, d] → [members, own, query heads, d] (transformers' layout), float32.

    The products run in the query's dtype, the softmax in float32, as the engine's dense attention
    (attention.py): bf16 products for a bf16 model, float32 throughout for a float32 one."""
    members, query_heads, own, dim = query.shape
    key_heads, prompt = kv.prefix_keys.shape[1], kv.prefix_keys.shape[2]
    group = query_heads // key_heads
    scale = dim**-0.5 if scaling is None else scaling
    compute = query.dtype
    queries = query.reshape(members, key_heads, group * own, dim)
    prefix_keys, prefix_values = kv.prefix_keys.to(compute), kv.prefix_values.to(compute)

    def prompt_scores(stacked: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
        keys = prefix_keys if groups is None else prefix_keys[groups]
        return torch.matmul(stacked, keys.transpose(-1, -2))

    def prompt_output(stacked: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
        return torch.matmul(stacked, prefix_values if groups is None else prefix_values[groups])

    scores = torch.cat(
        [kv.layout.per_group(queries, prompt_scores), torch.matmul(queries, kv.own_keys.to(compute).transpose(-1, -2))],
        dim=-1,
    )
    causal = torch.ones((own, own), dtype=torch.bool).tril()
    visible = torch.cat(
        [kv.prefix_mask[kv.layout.member_group][:, None, :].expand(members, own, prompt),
         causal.expand(members, own, own)],
        dim=-1,
    )  # [members, own, prompt + own]; every row sees itself
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[:, None, None]
    scores = torch.add(bias, scores.view(members, key_heads, group, own, -1), alpha=scale)  # float32, one pass
    weights = torch.softmax(scores, dim=-1).to(compute).view(members, key_heads, group * own, -1)
    output = kv.layout.per_group(weights[..., :prompt], prompt_output).float() + torch.matmul(
        weights[..., prompt:], kv.own_values.to(compute)
    ).float()
    return output.reshape(members, query_heads, own, dim).transpose(1, 2).contiguous()
