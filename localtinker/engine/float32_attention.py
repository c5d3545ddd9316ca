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
