"""Attention of a bf16 model computed in float32: torch's CPU bf16 flash-attention backward is slow.

Measured on an AVX512-BF16 EPYC (2026-11-24, SmolLM2, 4 × 128-token rows, 1 thread): the backward of
``scaled_dot_product_attention`` took 12.8 ms per layer in bf16 against 5.4 ms in float32, 11% of a
bf16 SFT step. Attention is a small share of the FLOPs, so upcasting q, k and v costs little; the
projections around it stay in bf16. Registered under its own name so other models in the process keep
transformers' ``sdpa``; masks are built exactly as for ``sdpa``.

Every engine model uses it, float32 ones too (where it is exactly ``sdpa``): a sampler's decode step
hands it the shared-prompt keys of ``shared_prompt_kv.py``, and the members of a trainer's shared-prompt
micro-batch those of ``shared_prefix_attention.py``, which plain ``sdpa`` cannot read.
"""

from __future__ import annotations

from typing import Any

import torch

from localtinker.engine.shared_prefix_attention import SharedPrefixKV, shared_prefix_attention
from localtinker.engine.shared_prompt_kv import SharedPromptKV, shared_prompt_attention

NAME = "localtinker_sdpa_float32"
_registered = False


def float32_sdpa(
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


def _is_plain_decode(query: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """One query token per row, no autograd, and none of the options that change the attention."""
    return query.shape[2] == 1 and not torch.is_grad_enabled() and not _changes_attention(kwargs)


def _changes_attention(kwargs: dict[str, Any]) -> bool:
    """Whether an option the shared-prompt attentions do not implement is set (``_CHANGING``, dropout)."""
    return any(kwargs.get(key) is not None for key in _CHANGING) or bool(kwargs.get("dropout"))


_CHANGING = ("softcap", "position_bias", "sliding_window", "s_aux", "cache", "head_mask")
