"""Every engine model's attention: products in the model's compute dtype, the softmax in float32.

bf16 models multiply q·kᵀ and the weights·v in bf16 (float32 accumulation inside oneDNN), with the
scores widened to float32 for the scale, the mask and the softmax, and the weights rounded back to bf16
for the second product: the numerics of transformers' ``eager`` attention under bf16, where FlashAttention
on a GPU differs only in keeping the scores in float32. torch's CPU attention kernels are slow on such
models' shapes (its bf16 flash backward is slower than its float32 one), and these products are 2-3×
faster per layer while rounding the scores to bf16 barely moves the model's logprobs (figures and the
bench that set this: docs/engine-notes.md, attention; bench/bench_engine_train.py).

These products keep the weights for the backward, 6 bytes per score (float32 for the softmax, bf16 for
the product) where flash keeps a few bytes per token: a call takes them only while its scores are at
most :data:`MAX_SCORES` (one 682-token row with SmolLM2's 9 heads; ~24 MB per layer). Larger calls,
float32 models (float32 products were no faster than flash: exactly transformers' ``sdpa``), float masks
and options the products do not implement go through ``sdpa`` in float32, as before; attention sinks and
soft caps, which no sdpa applies, as the portable path computes them (portable_attention.beyond_sdpa).

A sampler's decode steps hand it the shared-prompt keys of ``shared_prompt_kv.py``, and the members of a
trainer's shared-prompt micro-batch those of ``shared_prefix_attention.py``, which plain ``sdpa`` cannot
read. Registered under its own name so that other models in the process keep transformers' ``sdpa``;
masks are built exactly as for ``sdpa``.
"""

from __future__ import annotations

from typing import Any

import torch

from localtinker.engine.portable_attention import beyond_sdpa
from localtinker.engine.shared_prefix_attention import SharedPrefixKV, shared_prefix_attention
from localtinker.engine.shared_prompt_kv import SharedPromptKV, shared_prompt_attention

NAME = "localtinker_attention"
MAX_SCORES = 1 << 22  # elements of one call's [batch, heads, queries, keys] scores taking the bf16 products
_registered = False


def engine_attention(
    module: torch.nn.Module, query: torch.Tensor, key: Any, value: Any, attention_mask: Any, **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    if isinstance(key, SharedPromptKV):  # a sampler's decode step (decode_batch.py)
        if _is_plain_decode(query, kwargs):
            return shared_prompt_attention(query, key, kwargs.get("scaling")).to(dtype), None
        key, value, attention_mask = key.dense()
    elif isinstance(key, SharedPrefixKV):  # the members of a trainer's shared-prompt micro-batch (prefix_sharing.py)
        if not _changes_attention(kwargs):
            return shared_prefix_attention(query, key, kwargs.get("scaling")).to(dtype), None
        key, value = key.dense()
    beyond = beyond_sdpa(query, key, value, attention_mask, kwargs)  # sinks, soft caps: no sdpa has them
    if beyond is not None:
        return beyond.to(dtype), None
    if _takes_products(query, key, attention_mask, kwargs):
        causal = query.shape[2] > 1 and attention_mask is None and _is_causal(module, kwargs)
        return product_attention(query, key, value, attention_mask, kwargs.get("scaling"), causal), None
    output, weights = sdpa_attention_forward(
        module, query.float(), key.float(), value.float(), attention_mask, **kwargs
    )
    return output.to(dtype), weights


def product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      scaling: float | None, causal: bool) -> torch.Tensor:
    """softmax(q·kᵀ·scaling + mask)·v with the products in the inputs' dtype and the softmax in float32.

    [batch, query heads, queries, d] and [batch, key heads, keys, d] → [batch, queries, query heads, d]
    (transformers' layout). Query heads sharing a key head are stacked into one product, never expanding
    the keys. ``mask`` is sdpa's boolean [batch, 1, queries, keys] (True = visible) or None; ``causal``
    (with no mask) lets query i see keys 0..i, as sdpa's ``is_causal`` (transformers drops the keys past the
    queries). A row that sees no key gets uniform weights instead of NaN (left padding)."""
    batch, query_heads, queries, dim = query.shape
    key_heads, keys = key.shape[1], key.shape[2]
    group = query_heads // key_heads
    scale = dim**-0.5 if scaling is None else scaling
    scores = torch.matmul(query.reshape(batch, key_heads, group * queries, dim), key.transpose(-1, -2))
    scores = scores.view(batch, key_heads, group, queries, keys)
    if causal:
        visible = torch.ones((queries, keys), dtype=torch.bool).tril()
    elif mask is not None:
        visible = mask[:, :, None]  # [batch, 1, 1, queries, keys]
    else:
        visible = None
    if visible is None:
        scores = scores.float().mul_(scale)
    else:  # bias + scale × scores in one float32 pass (a masked_fill_ after widening takes 3 passes)
        bias = torch.zeros(visible.shape).masked_fill_(~visible, torch.finfo(torch.float32).min)
        scores = torch.add(bias, scores, alpha=scale)
    weights = torch.softmax(scores, dim=-1).to(query.dtype).view(batch, key_heads, group * queries, keys)
    output = torch.matmul(weights, value).view(batch, query_heads, queries, dim)
    return output.transpose(1, 2).contiguous()


def takes_engine_attention(model: torch.nn.Module) -> bool:
    """Whether the model's attention modules call transformers' attention interface, which
    :func:`use_engine_attention` switches; a model whose modules call their own kernels (Falcon, StableLM,
    Qwen3-Next in transformers 5) would keep them, and sample through a cache the engine cannot share."""
    return bool(getattr(type(model), "_supports_attention_backend", False))


def use_engine_attention(model: torch.nn.Module) -> None:
    """Switches ``model`` (a transformers model using ``sdpa``) to :func:`engine_attention`."""
    global _registered
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if not _registered:
        AttentionInterface.register(NAME, engine_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
        _registered = True
    model.set_attn_implementation(NAME)


def _takes_products(query: torch.Tensor, key: torch.Tensor, mask: Any, kwargs: dict[str, Any]) -> bool:
    """bf16 queries, a boolean mask or none, no option :func:`product_attention` lacks, at most
    :data:`MAX_SCORES` scores."""
    if query.dtype != torch.bfloat16 or key.dtype != torch.bfloat16 or _changes_attention(kwargs):
        return False
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1):
        return False
    batch, heads, queries, _ = query.shape
    return query.shape[1] % key.shape[1] == 0 and batch * heads * queries * key.shape[2] <= MAX_SCORES


def _is_causal(module: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    causal = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True) if causal is None else causal)


def _is_plain_decode(query: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """One query token per row, no autograd, and none of the options that change the attention."""
    return query.shape[2] == 1 and not torch.is_grad_enabled() and not _changes_attention(kwargs)


def _changes_attention(kwargs: dict[str, Any]) -> bool:
    """Whether an option the engine's own attentions do not implement is set (``_CHANGING``, dropout)."""
    return any(kwargs.get(key) is not None for key in _CHANGING) or bool(kwargs.get("dropout"))


_CHANGING = ("softcap", "position_bias", "sliding_window", "s_aux", "cache", "head_mask")
