"""Attention of the portable path (the CUDA path's code, runnable on any device): transformers' ``sdpa``,
plus what sdpa lacks.

- Packed training rows (``packed_rows.py``) pass ``cu_seq_lens_q`` / ``max_length_q``; on a CUDA device where
  torch has ``torch.nn.attention.varlen.varlen_attn`` (flash varlen, torch ≥ 2.10) that kernel runs them with
  no mask at all. Elsewhere transformers' packed-sequence mask (block-diagonal causal, sliding windows
  included) goes to sdpa, which is the same function.
- Gemma 2's attention-logit soft cap (``softcap``) and gpt-oss's attention sinks (``s_aux``: a learned logit per
  head that takes a share of the softmax and no value), which sdpa cannot apply, run as an explicit product
  (:func:`explicit_attention`: transformers' eager formulas, the softmax in float32); sinks without a cap go
  through sdpa with the sink as one more key (:func:`sink_attention`), which keeps no scores for the backward.
  The flash varlen kernel has neither: packed rows of such models take sinks over that kernel with a correction
  and soft caps on explicit kernels that keep no scores for the backward (beyond_flash.py), by the rows' bounds,
  through transformers' layers as through the written-out ones (packed_layers.py).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache
from typing import Any, Iterator

import torch

from localtinker.engine.beyond_flash import attention_beyond_flash
from localtinker.engine.device import runs_flash_kernels
from localtinker.engine.packed_layout import PackedLayout, segment_visibility

NAME = "localtinker_portable"
# the packed micro-batch whose rows transformers' layers take by their bounds, with no mask (see varlen_rows)
_varlen_rows: ContextVar[PackedLayout | None] = ContextVar("localtinker_varlen_rows", default=None)
_registered = False


def use_portable_attention(model: torch.nn.Module) -> None:
    """Switches ``model`` to :func:`portable_attention` (registered once per process)."""
    global _registered
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if not _registered:
        AttentionInterface.register(NAME, portable_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _portable_mask)
        _registered = True
    model.set_attn_implementation(NAME)


@contextmanager
def varlen_rows(layout: PackedLayout | None) -> Iterator[None]:
    """Within the block, the packed rows of ``layout`` (None: none) run by its bounds — the varlen kernel, or
    beyond_flash.py for sinks and soft caps — and transformers builds no mask for them."""
    token = _varlen_rows.set(layout)
    try:
        yield
    finally:
        _varlen_rows.reset(token)


def varlen_available(device: torch.device) -> bool:
    """Whether packed rows on ``device`` can take the flash varlen kernel: a CUDA card that runs flash kernels
    (device.py: sm80 on) and a torch that has it."""
    return runs_flash_kernels(device) and _varlen_function() is not None


def flash_takes(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed rows in ``dtype`` on ``device`` take the flash varlen kernel: :func:`varlen_available`, in
    bf16/fp16 (flash has no float32)."""
    return varlen_available(device) and dtype in (torch.bfloat16, torch.float16)


def _portable_mask(*args: Any, **kwargs: Any) -> Any:
    from transformers.masking_utils import sdpa_mask

    if _varlen_rows.get() is not None:
        return None  # the rows go by their bounds instead
    return sdpa_mask(*args, **kwargs)


def portable_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout = _varlen_rows.get()
    if layout is not None and kwargs.get("cu_seq_lens_q") is not None:  # packed rows, no mask
        if kwargs.get("softcap") or kwargs.get("s_aux") is not None:
            return _packed_beyond_flash(query, key, value, layout, kwargs), None
        return _varlen_attention(query, key, value, kwargs), None
    beyond = beyond_sdpa(query, key, value, attention_mask, kwargs)
    if beyond is not None:
        return beyond, None
    kwargs = {k: v for k, v in kwargs.items() if k not in ("softcap", "sliding_window", "s_aux")}
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)[0], None


def beyond_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any,
                kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The attention where ``kwargs`` ask for what no sdpa or flash kernel applies — sinks (``s_aux``: through
    sdpa as one more key, :func:`sink_attention`), a soft cap (the explicit product) — else None. Both the
    portable path's and the CPU path's attention (attention.py) route through it."""
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if softcap is None and sinks is None:
        return None
    if softcap is None:
        return sink_attention(query, key, value, mask, kwargs.get("scaling"), sinks)
    return explicit_attention(query, key, value, mask, kwargs.get("scaling"), softcap, sinks)


def explicit_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                       scaling: float | None, softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(cap·tanh(q·kᵀ·scaling / cap) + mask)·v, the softmax in float32; ``mask`` is sdpa's boolean
    [batch, 1, queries, keys] (True = visible), a float bias, or None (causal). With ``sinks`` [heads], each
    head's sink logit joins every row's softmax as one more column whose weight is dropped (gpt-oss): a row's
    weights then sum to less than 1. Returns [batch, queries, heads, d]."""
    heads, key_heads = query.shape[1], key.shape[1]
    if heads != key_heads:
        key = key.repeat_interleave(heads // key_heads, dim=1)
        value = value.repeat_interleave(heads // key_heads, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    queries, keys = scores.shape[-2], scores.shape[-1]
    if mask is None:
        mask = torch.ones((queries, keys), dtype=torch.bool, device=query.device).tril(keys - queries)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask[..., -keys:], torch.finfo(torch.float32).min)
    else:
        scores = scores + mask[..., -keys:].float()
    if sinks is None:
        weights = torch.softmax(scores, dim=-1).to(value.dtype)
    else:
        column = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1].to(value.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous()


def sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                   scaling: float | None, sinks: torch.Tensor) -> torch.Tensor:
    """:func:`explicit_attention` with ``sinks`` and no soft cap, through sdpa: its memory-efficient kernels keep
    no [queries × keys] scores for the backward, where the explicit product keeps them in float32 for every
    layer (a packed micro-batch of 4096 tokens and gpt-oss-20b's 64 heads: 4 GiB a layer). Each head's sink is
    one more key, in front of the others, with a zero value, visible to every query, whose score is the sink:
    the queries get one more component, 1, the keys 0 and the sink key sink / scaling (the dimensions padded by
    8, as the kernels take them), so every other score is unchanged. Returns [batch, queries, heads, d]."""
    batch, heads, queries, dim = query.shape
    keys, group = key.shape[2], heads // key.shape[1]
    scale = dim**-0.5 if scaling is None else scaling
    if group > 1:  # one sink per query head: the keys are expanded to the query heads
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    extra = query.new_zeros((batch, heads, queries, 8))
    extra[..., 0] = 1
    sink_key = key.new_zeros((batch, heads, 1, dim + 8))
    sink_key[..., 0, dim] = (sinks.float() / scale).to(key.dtype)
    q = torch.cat((query, extra), dim=-1)
    k = torch.cat((sink_key, torch.cat((key, key.new_zeros((batch, heads, keys, 8))), dim=-1)), dim=2)
    v = torch.cat((value.new_zeros((batch, heads, 1, dim + 8)), torch.cat((value, value.new_zeros(
        (batch, heads, keys, 8))), dim=-1)), dim=2)  # (the same width as q and k: every sdpa kernel takes that)
    if mask is None:
        mask = torch.ones((queries, keys), dtype=torch.bool, device=query.device).tril(keys - queries)[None, None]
    visible = mask[..., -keys:]
    if visible.dtype == torch.bool:
        sink_column = torch.ones((*visible.shape[:-1], 1), dtype=torch.bool, device=visible.device)
    else:
        sink_column = torch.zeros((*visible.shape[:-1], 1), dtype=visible.dtype, device=visible.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=torch.cat((sink_column, visible), -1),
                                                           scale=scale)
    return out[..., :dim].transpose(1, 2).contiguous()


@lru_cache(maxsize=1)
def _varlen_function() -> tuple[Any, bool, bool] | None:
    """(varlen_attn, takes window_size, takes enable_gqa), or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    return varlen_attn, "window_size" in parameters, "enable_gqa" in parameters


def _varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """Packed rows [1, heads, tokens, d] through the flash varlen kernel; returns [1, tokens, heads, d]."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, d]
    cu = kwargs["cu_seq_lens_q"]
    longest = int(kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max()))
    return _varlen_core(q, k, v, cu, longest, kwargs.get("scaling"), kwargs.get("sliding_window"))[None]


def _packed_beyond_flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: PackedLayout,
                         kwargs: dict[str, Any]) -> torch.Tensor:
    """Packed rows [1, heads, tokens, d] of ``layout`` with sinks (``s_aux``) or a soft cap through beyond_flash.py:
    the flash kernel with the sinks' correction, or explicit kernels, by the rows' bounds (no [tokens × tokens]
    mask); returns [1, tokens, heads, d]."""
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [tokens, heads, d]
    scaling = kwargs.get("scaling") or q.shape[-1] ** -0.5
    flash = flash_takes(q.device, q.dtype)
    return attention_beyond_flash(q, k, v, layout, scaling, kwargs.get("sliding_window"), kwargs.get("s_aux"),
                                  kwargs.get("softcap"), flash)[None]


def _varlen_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int,
                 scaling: float | None, window: int | None, cu_k: torch.Tensor | None = None,
                 longest_k: int | None = None) -> torch.Tensor:
    """Causal attention of packed rows q [tokens, heads, d], k/v [tokens, kv heads, d] (bounds ``cu``; the
    keys' own bounds ``cu_k`` where they differ) through the flash varlen kernel; returns [tokens, heads, d].
    A query segment shorter than its keys is aligned at their end (the kernel's causal mask)."""
    function, takes_window, takes_gqa = _varlen_function()
    heads, key_heads = q.shape[1], k.shape[1]
    if heads != key_heads and not takes_gqa:
        k, v = k.repeat_interleave(heads // key_heads, dim=1), v.repeat_interleave(heads // key_heads, dim=1)
    options: dict[str, Any] = {}
    if takes_window:
        options["window_size"] = (window - 1 if window else -1, 0)
    elif window:
        raise RuntimeError("this torch's varlen_attn has no sliding windows; packed rows need torch >= 2.11 here")
    else:
        options["is_causal"] = True
    if takes_gqa and heads != key_heads:
        options["enable_gqa"] = True
    if scaling is not None:
        if "scale" in inspect.signature(function).parameters:
            options["scale"] = scaling
        else:  # the kernel's own scale is d^-0.5
            q = q * (scaling * q.shape[-1] ** 0.5)
    return function(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu if cu_k is None else cu_k, longest,
                    longest if longest_k is None else longest_k, **options)


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, scaling: float,
                            window: int | None = None, sinks: torch.Tensor | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """Causal attention of packed rows by ``layout``'s segments (packed_layout.py): q [tokens, heads, d], k and v
    [tokens, kv heads, d], gathered into the segments' key order where the layout shares prompts. Returns
    [tokens, heads, d]. The flash varlen kernel on CUDA in bf16/fp16 (packed_layers.py's path); elsewhere one
    sdpa per segment, the same function (a segment shorter than its keys sees them all but its own future).
    A key segment is its datum's positions from 0, so with a sliding ``window`` a query at position p sees the
    keys after p − window, as transformers' sliding masks and the kernel's window (aligned at the keys' end) do.
    ``sinks`` [heads] (gpt-oss) and a ``softcap`` on the scores (Gemma 2): beyond_flash.py."""
    if layout.key_rows is not None:
        k, v = k.index_select(0, layout.key_rows), v.index_select(0, layout.key_rows)
    flash = flash_takes(q.device, q.dtype)
    if sinks is not None or softcap:
        return attention_beyond_flash(q, k, v, layout, scaling, window, sinks, softcap, flash)
    if flash:
        return _varlen_core(q, k, v, layout.cu_q, layout.max_q, scaling, window, layout.cu_k, layout.max_k)
    group = q.shape[1] // k.shape[1]
    outputs, q_start, k_start = [], 0, 0
    for q_length, k_length in zip(layout.q_lengths, layout.k_lengths):
        queries = q[q_start : q_start + q_length].transpose(0, 1)
        keys = k[k_start : k_start + k_length].transpose(0, 1)
        values = v[k_start : k_start + k_length].transpose(0, 1)
        q_start, k_start = q_start + q_length, k_start + k_length
        if group > 1:
            keys, values = keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)
        if k_length == q_length and not (window and k_length > window):
            options: dict[str, Any] = {"is_causal": True}
        else:
            options = {"attn_mask": segment_visibility(q_length, k_length, window, q.device)}
        out = torch.nn.functional.scaled_dot_product_attention(queries[None], keys[None], values[None], scale=scaling,
                                                               **options)
        outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]
