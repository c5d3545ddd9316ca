"""Attention of a bf16 model computed in float32: torch's CPU bf16 flash-attention backward is slow.

Measured on an AVX512-BF16 EPYC (2026-11-24, SmolLM2, 4 × 128-token rows, 1 thread): the backward of
``scaled_dot_product_attention`` took 12.8 ms per layer in bf16 against 5.4 ms in float32, 11% of a
bf16 SFT step. Attention is a small share of the FLOPs, so upcasting q, k and v costs little; the
projections around it stay in bf16. Registered under its own name so other models in the process keep
transformers' ``sdpa``; masks are built exactly as for ``sdpa``.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "localtinker_sdpa_float32"
_registered = False


def float32_sdpa(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    if _is_plain_decode(query, attention_mask, kwargs):
        return decode_attention(query, key, value, attention_mask, kwargs.get("scaling")).to(dtype), None
    output, weights = sdpa_attention_forward(
        module, query.float(), key.float(), value.float(), attention_mask, **kwargs
    )
    return output.to(dtype), weights


def use_float32_attention(model: torch.nn.Module) -> None:
    """Switches ``model`` (a transformers model using ``sdpa``) to :func:`float32_sdpa`."""
    global _registered
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if not _registered:
        AttentionInterface.register(NAME, float32_sdpa)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
        _registered = True
    model.set_attn_implementation(NAME)


def _is_plain_decode(query: torch.Tensor, attention_mask: Any, kwargs: dict[str, Any]) -> bool:
    """One query token per row, no autograd, no mask or a boolean one, and none of the options that change
    the attention (``_CHANGING``): a sampler's decode step."""
    mask_ok = attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool)
    changed = any(kwargs.get(key) is not None for key in _CHANGING) or bool(kwargs.get("dropout"))
    return query.shape[2] == 1 and not torch.is_grad_enabled() and mask_ok and not changed


# Keyword arguments of transformers' attention interface that :func:`decode_attention` does not implement.
_CHANGING = ("softcap", "position_bias", "sliding_window", "s_aux", "cache", "head_mask")


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float | None) -> torch.Tensor:
    """softmax(q·kᵀ·scaling + mask)·v in float32 for one query per row, the query heads of a key/value head
    grouped into one small product: [rows, q heads, 1, d] → [rows, 1, q heads, d] (transformers' layout).

    In a decode step the flash kernel's per-block setup dominates: 512 rows over ~50 bf16 keys took 10.3 ms
    per layer through it (keys and values widened to float32 first) and 7.8 ms here, of which 3.3 ms is
    the widening (AVX512-BF16 EPYC, 2026-11-24, one thread). The function is the trainer's (float32
    flash, same inputs) up to float32 rounding.
    """
    rows, query_heads, _, dim = query.shape
    key_heads = key.shape[1]
    grouped = query.float().reshape(rows, key_heads, query_heads // key_heads, dim)
    scores = torch.matmul(grouped, key.float().transpose(-1, -2))  # [rows, key heads, group, keys]
    scores.mul_(dim**-0.5 if scaling is None else scaling)
    if mask is not None:
        scores.masked_fill_(~mask.reshape(rows, 1, 1, -1), float("-inf"))
    output = torch.matmul(scores.softmax(dim=-1), value.float())  # [rows, key heads, group, d]
    return output.reshape(rows, query_heads, 1, dim).transpose(1, 2).contiguous()
