"""The decode KV cache in which the rows of one prompt share that prompt's columns (cascade attention).

A GRPO group is G rows over one prompt. With the prompt's keys and values copied to every row, each decode
step read them G times. Here a prompt's keys and values are stored once, and the attention of a decode
step (:func:`shared_prompt_attention`) has two parts merged exactly through their maxima and sums of
exponentials:

- *prompt part*: the queries of all rows of one prompt against its keys, as one product per prompt
  ([rows of the prompt × query heads of a key head] × keys), reading each prompt once;
- *own part*: each row against the columns it generated itself.

About twice as fast per layer as copied prompts for 64 prompts × 8 rows (docs/engine-notes.md, shared
prompts; bench/bench_rl_sampling.py).

Layout, chosen so that padding never costs more than about a quarter of what is stored:

- *prompt shelves*: prompts of about the same length (one width class, :func:`width_class`) share a
  tensor ``[prompts, key heads, columns, dim]``, left-aligned by padding that a 0/1 mask hides. One
  tensor for every prompt made each prompt as wide as the longest, so one 1000-token prompt among short
  ones made a batch several times slower (bench/bench_rl_sampling.py's long-prompt line).
- *cohorts*: the rows that joined at about the same decode step share a tensor of their own columns
  ``[rows, key heads, columns, dim]``, with spare columns after the last so that a step writes its
  column in place. One tensor for every row made a row that joins late as wide as the oldest.

``prompt_of_row`` says which prompt a row extends; a prompt id names a (shelf, slot). Rows are grouped
by (shelf, rows per prompt) for the prompt part when rows join or leave (:class:`RowGroups`), not per
layer or step. A request whose prompt is already in the cache adds rows pointing at it: nothing is copied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from localtinker.engine.fast_exp import exp_
from localtinker.engine.kv_rows import ColumnBufferLayer, RowCache, first_used_column, left_pad

_NARROW = 32  # columns: every width up to this is one class (padding of a few columns is not worth a tensor)
_CLASS_RATIO = 1.25  # widths in one class differ by at most this factor above _NARROW
_SLACK_COLUMNS = 8  # padding columns a cohort may give a row whatever its width


def width_class(width: int) -> int:
    """Widths of one class share a tensor: within a factor of 1.25 (all widths up to 32 are class 0)."""
    return 0 if width <= _NARROW else math.ceil(math.log(width / _NARROW) / math.log(_CLASS_RATIO) - 1e-9)


def close_widths(older: int, younger: int) -> bool:
    """Whether two cohorts are close enough in width to share one tensor (padding at most ~¼ of it)."""
    return abs(older - younger) <= max(_SLACK_COLUMNS, (_CLASS_RATIO - 1) * max(older, younger))


@dataclass(frozen=True)
class Bucket:
    """Prompts of one shelf that have the same number of rows: one batched product covers them all."""

    shelf: int
    slots: torch.Tensor  # [prompts in bucket] slots of the shelf
    rows: torch.Tensor  # [prompts in bucket, rows per prompt] row ids
    start: int  # where the bucket's rows begin in the concatenation of all buckets' rows
    whole_shelf: bool  # the slots are the shelf's, in order: its tensors are used as they are


class RowGroups:
    """The rows of each prompt, bucketed by (shelf, group size): a GRPO batch is often one bucket in row order."""

    def __init__(self, prompt_of_row: torch.Tensor, shelf_of_prompt: torch.Tensor, slot_of_prompt: torch.Tensor,
                 shelf_sizes: list[int]) -> None:
        counts = torch.bincount(prompt_of_row, minlength=len(shelf_of_prompt))
        by_prompt = torch.argsort(prompt_of_row, stable=True)
        starts = counts.cumsum(0) - counts
        self.buckets: list[Bucket] = []
        start = 0
        for shelf, size in sorted(set(zip(shelf_of_prompt.tolist(), counts.tolist()))):
            if size == 0:
                continue
            chosen = ((shelf_of_prompt == shelf) & (counts == size)).nonzero().flatten()
            rows = by_prompt[starts[chosen, None] + torch.arange(size)]
            slots = slot_of_prompt[chosen]
            whole = len(slots) == shelf_sizes[shelf] and bool(torch.equal(slots, torch.arange(len(slots))))
            self.buckets.append(Bucket(shelf, slots, rows, start, whole))
            start += rows.numel()
        order = torch.cat([bucket.rows.flatten() for bucket in self.buckets])
        self.in_row_order = bool(torch.equal(order, torch.arange(len(order))))
        self.inverse = torch.argsort(order)  # position in bucket order of each row


@dataclass
class Cohort:
    """Rows ``start .. start + rows`` that joined at about the same step and share a tensor of own columns."""

    start: int
    rows: int
    columns: int = 0
    mask: torch.Tensor | None = None  # bool [rows, columns] when some rows joined after its first column

    @property
    def stop(self) -> int:
        return self.start + self.rows


class SharedPromptLayer(DynamicLayer):
    """One layer's prompt shelves (each prompt stored once) and each cohort's own columns."""

    def __init__(self, owner: SharedPromptCache) -> None:
        super().__init__()
        self.owner = owner
        self.prompt_keys: list[torch.Tensor] = []  # per shelf [prompts, key heads, columns, dim]
        self.prompt_values: list[torch.Tensor] = []
        self.own: list[ColumnBufferLayer] = []  # per cohort

    def get_seq_length(self) -> int:
        """Columns the widest row would have with its prompt copied in (transformers sizes its masks by it)."""
        prompt = max((keys.shape[-2] for keys in self.prompt_keys), default=0)
        return prompt + max((cohort.columns for cohort in self.owner.cohorts), default=0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Writes a decode step's column (one per row) in place; returns views for the attention."""
        for cohort, own in zip(self.owner.cohorts, self.own):
            own.update(key_states[cohort.start : cohort.stop], value_states[cohort.start : cohort.stop])
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        view = SharedPromptKV(self, self.owner)
        return view, view


@dataclass(frozen=True)
class SharedPromptKV:
    """What a :class:`SharedPromptLayer` hands the attention in place of dense keys and values."""

    layer: SharedPromptLayer
    cache: SharedPromptCache

    def dense(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values ``[rows, key heads, columns, dim]`` and a boolean mask ``[rows, 1, 1, columns]``
        with every row's prompt copied in: for attention options the shared path does not implement."""
        layer, cache = self.layer, self.cache
        prompt_width = max(keys.shape[-2] for keys in layer.prompt_keys)
        own_width = max(cohort.columns for cohort in cache.cohorts)
        sample = layer.prompt_keys[0]
        keys = sample.new_zeros((cache.rows, sample.shape[1], prompt_width + own_width, sample.shape[-1]))
        values = torch.zeros_like(keys)
        mask = torch.zeros((cache.rows, prompt_width + own_width), dtype=torch.bool)
        shelf_of_row = cache.shelf_of_prompt[cache.prompt_of_row]
        for shelf, shelf_mask in enumerate(cache.prompt_masks):
            rows = (shelf_of_row == shelf).nonzero().flatten()
            slots = cache.slot_of_prompt[cache.prompt_of_row[rows]]
            begin = prompt_width - shelf_mask.shape[1]
            keys[rows, :, begin:prompt_width] = layer.prompt_keys[shelf][slots]
            values[rows, :, begin:prompt_width] = layer.prompt_values[shelf][slots]
            mask[rows, begin:prompt_width] = shelf_mask[slots]
        for cohort, own in zip(cache.cohorts, layer.own):
            begin = prompt_width + own_width - cohort.columns
            keys[cohort.start : cohort.stop, :, begin:] = own.keys
            values[cohort.start : cohort.stop, :, begin:] = own.values
            mask[cohort.start : cohort.stop, begin:] = True if cohort.mask is None else cohort.mask
        return keys, values, mask[:, None, None, :]


class SharedPromptCache(DynamicCache):
    """Rows decoding together; see the module docstring. Starts empty; grows with :meth:`add_prompts` and
    :meth:`add_rows`, shrinks with :meth:`keep_rows`, gains a column per row with :meth:`open_column`."""

    def __init__(self, layers: int) -> None:
        Cache.__init__(self, layers=[SharedPromptLayer(self) for _ in range(layers)])
        self.prompt_masks: list[torch.Tensor] = []  # per shelf, bool [prompts, columns]
        self.shelf_classes: list[int] = []  # per shelf, its width class
        self.shelf_of_prompt = torch.zeros((0,), dtype=torch.long)
        self.slot_of_prompt = torch.zeros((0,), dtype=torch.long)
        self.prompt_of_row = torch.zeros((0,), dtype=torch.long)
        self.cohorts: list[Cohort] = []

    @property
    def rows(self) -> int:
        return len(self.prompt_of_row)

    @property
    def prompts(self) -> int:
        return len(self.shelf_of_prompt)

    @property
    def stored_columns(self) -> int:
        """Key/value columns held per layer and key head, padding included (what memory is spent on)."""
        prompts = sum(mask.numel() for mask in self.prompt_masks)
        return prompts + sum(cohort.rows * cohort.columns for cohort in self.cohorts)

    @cached_property
    def groups(self) -> RowGroups:
        return RowGroups(self.prompt_of_row, self.shelf_of_prompt, self.slot_of_prompt,
                         [len(mask) for mask in self.prompt_masks])

    def add_prompts(self, prefill: RowCache, mask: torch.Tensor, index: torch.Tensor) -> int:
        """Adds the prompts ``index`` (rows of one prefill chunk's cache and 0/1 mask, as the prefill makes
        them) to the shelf of their padded width's class; returns the id of the first (the others follow)."""
        first = self.prompts
        everything = torch.equal(index, torch.arange(len(mask)))
        mask = mask.bool() if everything else mask[index].bool()
        trim = first_used_column(mask)
        mask = mask[:, trim:]
        width_of_class = width_class(mask.shape[1])
        shelf = self.shelf_classes.index(width_of_class) if width_of_class in self.shelf_classes else None
        for layer, source in zip(self.layers, prefill.layers):
            keys, values = (source.keys, source.values) if everything else (source.keys[index], source.values[index])
            keys, values = keys[:, :, trim:], values[:, :, trim:]
            if shelf is None:  # an exact copy: the prefill's buffers have spare columns, freed with them
                layer.prompt_keys.append(keys.contiguous())
                layer.prompt_values.append(values.contiguous())
            else:
                held_keys, held_values = layer.prompt_keys[shelf], layer.prompt_values[shelf]
                width = max(keys.shape[-2], held_keys.shape[-2])
                layer.prompt_keys[shelf] = torch.cat([left_pad(held_keys, width), left_pad(keys, width)])
                layer.prompt_values[shelf] = torch.cat([left_pad(held_values, width), left_pad(values, width)])
        if shelf is None:
            shelf, slots = len(self.prompt_masks), torch.arange(len(mask))
            self.prompt_masks.append(mask)
            self.shelf_classes.append(width_of_class)
        else:
            held = self.prompt_masks[shelf]
            width = max(held.shape[1], mask.shape[1])
            slots = len(held) + torch.arange(len(mask))
            self.prompt_masks[shelf] = torch.cat([_left_pad_mask(held, width), _left_pad_mask(mask, width)])
        self.shelf_of_prompt = torch.cat([self.shelf_of_prompt, torch.full((len(mask),), shelf)])
        self.slot_of_prompt = torch.cat([self.slot_of_prompt, slots])
        self._changed()
        return first

    def add_rows(self, prompt_ids: torch.Tensor) -> None:
        """Appends rows extending ``prompt_ids``, with no columns of their own yet. They join the newest
        cohort while it is narrow (its columns are masked padding for them), else start a cohort."""
        added = len(prompt_ids)
        newest = self.cohorts[-1] if self.cohorts else None
        if newest is not None and newest.columns <= _SLACK_COLUMNS:
            if newest.columns:
                for layer in self.layers:
                    own = layer.own[-1]
                    fresh = own.keys.new_zeros((added, *own.keys.shape[1:]))
                    layer.own[-1] = ColumnBufferLayer(torch.cat([own.keys, fresh]), torch.cat([own.values, fresh]))
                held = newest.mask if newest.mask is not None else _all_columns(newest)
                newest.mask = torch.cat([held, held.new_zeros((added, newest.columns))])
            newest.rows += added
        else:
            self.cohorts.append(Cohort(start=self.rows, rows=added))
            for layer in self.layers:
                layer.own.append(ColumnBufferLayer())
        self.prompt_of_row = torch.cat([self.prompt_of_row, prompt_ids])
        self._changed()

    def row_keys_values(self, row: int, own_columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[layers, key heads, columns, dim]`` of row ``row``'s real columns: its prompt's,
        then its first ``own_columns`` own ones (a finished row's later columns are stale). A copy."""
        prompt = int(self.prompt_of_row[row])
        shelf, slot = int(self.shelf_of_prompt[prompt]), int(self.slot_of_prompt[prompt])
        prompt_columns = self.prompt_masks[shelf][slot].nonzero().flatten()
        number, cohort = next((n, c) for n, c in enumerate(self.cohorts) if c.start <= row < c.stop)
        local = row - cohort.start
        own = torch.arange(cohort.columns) if cohort.mask is None else cohort.mask[local].nonzero().flatten()
        own = own[:own_columns]
        width = len(prompt_columns) + len(own)
        sample_keys, sample_values = self.layers[0].prompt_keys[shelf], self.layers[0].prompt_values[shelf]
        keys = sample_keys.new_empty((len(self.layers), sample_keys.shape[1], width, sample_keys.shape[-1]))
        values = sample_values.new_empty((*keys.shape[:-1], sample_values.shape[-1]))
        for index, layer in enumerate(self.layers):
            held = layer.own[number]
            keys[index, :, : len(prompt_columns)] = layer.prompt_keys[shelf][slot][:, prompt_columns]
            keys[index, :, len(prompt_columns) :] = held.keys[local][:, own]
            values[index, :, : len(prompt_columns)] = layer.prompt_values[shelf][slot][:, prompt_columns]
            values[index, :, len(prompt_columns) :] = held.values[local][:, own]
        return keys, values

    def open_column(self) -> None:
        """Before a decode step: every row attends to the column the step is about to write."""
        for cohort in self.cohorts:
            cohort.columns += 1
            if cohort.mask is not None:
                cohort.mask = torch.cat([cohort.mask, cohort.mask.new_ones((cohort.rows, 1))], dim=1)

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keeps the rows ``index`` (increasing), the prompts they extend and the columns still seen; merges
        cohorts that have become close in width (the copy is being made anyway)."""
        used, self.prompt_of_row = torch.unique(self.prompt_of_row[index], return_inverse=True)
        self._keep_prompts(used)
        self._keep_cohort_rows(index)
        self._changed()

    def _keep_prompts(self, used: torch.Tensor) -> None:
        """Keeps the prompts ``used`` (increasing ids), renumbered 0.. in that order."""
        shelf_of_used, slot_of_used = self.shelf_of_prompt[used], self.slot_of_prompt[used]
        masks, classes, kept = [], [], []
        shelf_of_prompt, slot_of_prompt = torch.empty_like(used), torch.empty_like(used)
        for shelf, mask in enumerate(self.prompt_masks):
            mine = (shelf_of_used == shelf).nonzero().flatten()
            if not len(mine):
                continue
            slots = slot_of_used[mine]
            trim = first_used_column(mask[slots])
            whole = trim == 0 and len(slots) == len(mask) and bool(torch.equal(slots, torch.arange(len(slots))))
            kept.append((shelf, None if whole else slots, trim))
            masks.append(mask if whole else mask[slots, trim:])
            classes.append(self.shelf_classes[shelf])
            shelf_of_prompt[mine], slot_of_prompt[mine] = len(masks) - 1, torch.arange(len(mine))
        for layer in self.layers:
            layer.prompt_keys = [_select(layer.prompt_keys[shelf], slots, trim) for shelf, slots, trim in kept]
            layer.prompt_values = [_select(layer.prompt_values[shelf], slots, trim) for shelf, slots, trim in kept]
        self.prompt_masks, self.shelf_classes = masks, classes
        self.shelf_of_prompt, self.slot_of_prompt = shelf_of_prompt, slot_of_prompt

    def _keep_cohort_rows(self, index: torch.Tensor) -> None:
        """Keeps the rows ``index`` of every cohort; drops emptied cohorts, merges neighbours close in width."""
        plans: list[list[tuple[int, torch.Tensor, int]]] = []  # per new cohort: (old cohort, its rows, trim)
        cohorts: list[Cohort] = []
        for number, cohort in enumerate(self.cohorts):
            local = index[(index >= cohort.start) & (index < cohort.stop)] - cohort.start
            if not len(local):
                continue
            mask = None if cohort.mask is None else cohort.mask[local]
            trim = 0 if mask is None else first_used_column(mask)
            mask = None if mask is None or bool(mask[:, trim:].all()) else mask[:, trim:]
            kept = Cohort(start=0, rows=len(local), columns=cohort.columns - trim, mask=mask)
            if cohorts and kept.columns and cohorts[-1].columns and close_widths(cohorts[-1].columns, kept.columns):
                cohorts[-1] = _merged(cohorts[-1], kept)
                plans[-1].append((number, local, trim))
            else:
                cohorts.append(kept)
                plans.append([(number, local, trim)])
        start = 0
        for cohort in cohorts:
            cohort.start, start = start, start + cohort.rows
        for layer in self.layers:
            layer.own = [_merged_columns(layer.own, plan, cohort.columns) for plan, cohort in zip(plans, cohorts)]
        self.cohorts = cohorts

    def _changed(self) -> None:
        self.__dict__.pop("groups", None)


def _select(tensor: torch.Tensor, slots: torch.Tensor | None, trim: int) -> torch.Tensor:
    return tensor if slots is None else tensor[slots, :, trim:]


def _merged(older: Cohort, younger: Cohort) -> Cohort:
    """One cohort of both, as wide as the wider; the narrower's missing columns masked."""
    width = max(older.columns, younger.columns)
    mask = torch.cat([_left_pad_mask(_all_columns(c) if c.mask is None else c.mask, width) for c in (older, younger)])
    return Cohort(start=0, rows=older.rows + younger.rows, columns=width, mask=None if bool(mask.all()) else mask)


def _merged_columns(own: list[ColumnBufferLayer], plan: list[tuple[int, torch.Tensor, int]],
                    width: int) -> ColumnBufferLayer:
    """A new cohort's own columns from the kept rows of the old cohorts in ``plan``, left-padded to ``width``."""
    if not width:
        return ColumnBufferLayer()
    keys = [left_pad(own[number].keys[local, :, trim:], width) for number, local, trim in plan]
    values = [left_pad(own[number].values[local, :, trim:], width) for number, local, trim in plan]
    return ColumnBufferLayer(torch.cat(keys) if len(keys) > 1 else keys[0],
                             torch.cat(values) if len(values) > 1 else values[0])


def shared_prompt_attention(query: torch.Tensor, kv: SharedPromptKV, scaling: float | None) -> torch.Tensor:
    """softmax(q·kᵀ·scaling + mask)·v for one query per row over its prompt's shared columns and its own:
    [rows, q heads, 1, d] → [rows, 1, q heads, d] (transformers' layout), float32.

    Each part yields its unnormalised output, row maximum and sum of exponentials; the two merge exactly
    (the softmax over all columns), up to float32 rounding. The products run in the query's dtype and
    the rest in float32, as the engine's dense attention (attention.py).
    """
    rows, query_heads, _, dim = query.shape
    layer, cache = kv.layer, kv.cache
    key_heads = layer.prompt_keys[0].shape[1]
    group = query_heads // key_heads
    scale = dim**-0.5 if scaling is None else scaling
    queries = query.reshape(rows, key_heads, group, dim)
    groups = cache.groups
    prompt_out, prompt_max, prompt_sum = _joined(
        [_prompt_part(queries, layer, cache.prompt_masks, bucket, groups, scale) for bucket in groups.buckets]
    )
    if not groups.in_row_order:
        prompt_out, prompt_max, prompt_sum = (t[groups.inverse] for t in (prompt_out, prompt_max, prompt_sum))
    own_out, own_max, own_sum = _joined(
        [_own_part(queries, cohort, own, scale) for cohort, own in zip(cache.cohorts, layer.own)]
    )
    top = torch.maximum(prompt_max, own_max)
    prompt_weight, own_weight = (prompt_max - top).exp_(), (own_max - top).exp_()
    total = prompt_sum * prompt_weight + own_sum * own_weight
    output = (prompt_out * prompt_weight + own_out * own_weight) / total
    return output.reshape(rows, query_heads, 1, dim).transpose(1, 2).contiguous()


def _joined(parts: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    return parts[0] if len(parts) == 1 else tuple(torch.cat(part) for part in zip(*parts))


def _own_part(queries: torch.Tensor, cohort: Cohort, own: ColumnBufferLayer,
              scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The own part for one cohort's rows (consecutive): each row against its own columns."""
    compute = queries.dtype
    # The own keys are a view of a buffer with spare columns: made contiguous first, a bf16 product with
    # their transpose took 278 instead of 718 µs at 512 rows × 15 columns (it copied them transposed).
    keys = own.keys.to(compute).contiguous()
    scores = torch.matmul(queries[cohort.start : cohort.stop], keys.transpose(-1, -2))
    mask = None if cohort.mask is None else cohort.mask[:, None, None, :]
    return _softmax_parts(scores.float().mul_(scale), mask, own.values.to(compute))


def _prompt_part(queries: torch.Tensor, layer: SharedPromptLayer, prompt_masks: list[torch.Tensor], bucket: Bucket,
                 groups: RowGroups, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompt part for one bucket, in bucket order: ``[prompts × rows per prompt, key heads, group, …]``."""
    prompts, size = bucket.rows.shape
    _, key_heads, group, dim = queries.shape
    if groups.in_row_order:
        mine = queries[bucket.start : bucket.start + prompts * size]
    else:
        mine = queries[bucket.rows.flatten()]
    # [prompts, size, key heads, group, d] → [prompts, key heads, size × group, d]: one product per prompt.
    stacked = mine.reshape(prompts, size, key_heads, group, dim).transpose(1, 2).reshape(prompts, key_heads, -1, dim)
    keys, values, mask = layer.prompt_keys[bucket.shelf], layer.prompt_values[bucket.shelf], prompt_masks[bucket.shelf]
    if not bucket.whole_shelf:
        keys, values, mask = keys[bucket.slots], values[bucket.slots], mask[bucket.slots]
    scores = torch.matmul(stacked, keys.to(stacked.dtype).transpose(-1, -2)).float().mul_(scale)
    parts = _softmax_parts(scores, mask[:, None, None, :], values.to(stacked.dtype))
    return tuple(_to_rows(part, prompts, size, key_heads, group) for part in parts)


def _to_rows(part: torch.Tensor, prompts: int, size: int, key_heads: int, group: int) -> torch.Tensor:
    grouped = part.reshape(prompts, key_heads, size, group, -1).transpose(1, 2)
    return grouped.reshape(prompts * size, key_heads, group, -1)


def _softmax_parts(scores: torch.Tensor, mask: torch.Tensor | None,
                   values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(exp(s - max)·v, max, Σ exp(s - max)) over the unmasked columns, float32; every row has at least
    one. The product runs in ``values``' dtype."""
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    weights = exp_(scores.sub_(top))
    return torch.matmul(weights.to(values.dtype), values).float(), top, weights.sum(dim=-1, keepdim=True)


def _all_columns(cohort: Cohort) -> torch.Tensor:
    return torch.ones((cohort.rows, cohort.columns), dtype=torch.bool)


def _left_pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(mask, (width - mask.shape[1], 0))
