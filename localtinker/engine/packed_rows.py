"""The portable trainer's forward: datums packed end to end into one padding-free row per micro-batch.

Each datum keeps its own positions (0, 1, ...) and attends only to itself: on CUDA the flash varlen kernel
takes the rows' boundaries (``cu_seq_lens``, portable_attention.py); elsewhere transformers reads the
restarting position ids as packed sequences and builds the block-diagonal causal mask (or, for a model whose
forward builds its masks without the position ids, gpt-oss's in transformers 5, this module builds them the same
way and hands them in: :func:`packed_masks`). No token is padding,
so chat-like batches of 20- and 500-token rows cost their real tokens only. Through the written-out layers
(packed_layers.py), datums that share a prompt (a GRPO group, a DPO pair) run it once (packed_layout.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from localtinker.engine.attention import takes_engine_attention
from localtinker.engine.families import attention_softcap
from localtinker.engine.packed_layout import PackedBatch, packed_batches
from localtinker.engine.portable_attention import flash_takes, varlen_rows
from localtinker.engine.prefix_sharing import TokenRows

if TYPE_CHECKING:
    from localtinker.engine.packed_layers import PackedLayers


# Bytes of activations a packed token keeps for the backward, per layer: ~24 hidden-sized and ~8
# intermediate-sized bf16 tensors (norms, projections, attention output, MLP gates) — a round upper bound.
_HIDDEN_TENSORS, _INTERMEDIATE_TENSORS, _BYTES = 24, 8, 2
# An MoE layer keeps its MLP's tensors once per expert a token goes through (expert_lora.py's forward keeps each
# (token, choice) row: the gathered input, gate/up, the gated product, the output before and after its weight).
_EXPERT_HIDDEN_TENSORS = 4
_MEMORY_SHARE = 0.6  # of the device's free memory; the rest for the logit chunks, the optimizer and slack
SHARE_PROMPTS = True  # through the written-out layers, a prompt several datums share runs once per micro-batch


def device_microbatch_tokens(config: object, device: torch.device, ceiling: int) -> int:
    """Tokens per packed micro-batch on ``device``: as many as the activations of one fit in a share of its free
    memory (a power of two, at least 1024, at most ``ceiling``). An 8B model takes 2048 on an 80 GB card (beside its
    weights), a 1B one the ceiling; an MoE counts its MLP once per expert a token goes through."""
    if device.type != "cuda":
        return ceiling
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(text.hidden_size)
    intermediate = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    mlp = _INTERMEDIATE_TENSORS * intermediate
    experts_per_token = int(getattr(text, "num_experts_per_tok", None) or 0)
    if experts_per_token:
        expert = int(getattr(text, "moe_intermediate_size", None) or intermediate)
        mlp = experts_per_token * (_INTERMEDIATE_TENSORS * expert + _EXPERT_HIDDEN_TENSORS * hidden)
    per_token = text.num_hidden_layers * (_HIDDEN_TENSORS * hidden + mlp) * _BYTES
    free, _ = torch.cuda.mem_get_info(device)
    fitting = int(_MEMORY_SHARE * free / per_token)
    tokens = 1024
    while tokens * 2 <= min(fitting, ceiling):
        tokens *= 2
    return tokens


def takes_varlen(decoder: torch.nn.Module, device: torch.device) -> bool:
    """Whether packed rows go through transformers' layers by their bounds, with no [tokens × tokens] mask: through
    the flash varlen kernel where it takes them (portable_attention.flash_takes: a CUDA card from sm80, bf16/fp16);
    with attention sinks (gpt-oss) or a soft cap on the scores (Gemma 2) through beyond_flash.py, on any device and
    dtype (its explicit kernels where flash cannot run)."""
    if attention_softcap(decoder.config) or has_attention_sinks(decoder):
        return True
    return flash_takes(device, next(decoder.parameters()).dtype)


def has_attention_sinks(decoder: torch.nn.Module) -> bool:
    """Whether the decoder's attention layers have sinks (gpt-oss: a learned logit per head, ``sinks``)."""
    return any(isinstance(getattr(getattr(layer, "self_attn", None), "sinks", None), torch.Tensor)
               for layer in getattr(decoder, "layers", ()))


def packed_token_rows(
    decoder: torch.nn.Module, tokens: list[torch.Tensor], targets: list[torch.Tensor], budget: int,
    device: torch.device, layers: PackedLayers | None = None,
) -> Iterator[TokenRows]:
    """Hidden states of every datum position, one packed micro-batch of at most ``budget`` tokens at a time;
    through ``layers`` (packed_layers.py) where given and it computes the active adapter, else transformers'
    layers. Through ``layers``, datums that share a prompt run it once (packed_layout.py, :data:`SHARE_PROMPTS`).
    A decoder whose attention modules bypass transformers' attention interface (Falcon, StableLM) would attend
    across the datums of a packed row: each of its datums runs alone."""
    if not takes_engine_attention(decoder):
        budget = 1  # (a datum longer than the budget runs alone)
    share = SHARE_PROMPTS and layers is not None and layers.computes_active_adapter()
    for batch in packed_batches(tokens, targets, budget, share):
        yield packed_rows(decoder, batch, device, layers)


def packed_rows(decoder: torch.nn.Module, batch: PackedBatch, device: torch.device,
                layers: PackedLayers | None = None) -> TokenRows:
    input_ids = batch.input_ids.to(device, non_blocking=True)
    position_ids = batch.position_ids.to(device, non_blocking=True)
    layout = batch.layout(device)
    hidden = None if layers is None else layers.hidden(input_ids, position_ids, layout)
    if hidden is None:
        if layout.shared:
            raise RuntimeError("a micro-batch laid out with shared prompts needs the written-out layers "
                               "(packed_token_rows shares only where they compute the active adapter)")
        varlen = takes_varlen(decoder, device)
        inputs: dict = {"input_ids": input_ids[None]}
        if not varlen and _masks_ignore_positions(type(decoder)):
            embeds = decoder.embed_tokens(input_ids[None])
            inputs = {"inputs_embeds": embeds, "attention_mask": packed_masks(decoder, embeds, position_ids[None])}
        with varlen_rows(layout if varlen else None):
            hidden = decoder(
                **inputs, position_ids=position_ids[None], use_cache=False, cu_seq_lens_q=layout.cu_q,
                cu_seq_lens_k=layout.cu_k, max_length_q=layout.max_q, max_length_k=layout.max_k,
            ).last_hidden_state[0]
    # The rows stay on the host: the loss gathers them in one copy (engine._micro_batch_loss).
    return TokenRows(hidden, batch.targets.to(device, non_blocking=True), batch.datum_rows)


def packed_masks(decoder: torch.nn.Module, embeds: torch.Tensor, position_ids: torch.Tensor) -> dict:
    """Each layer type's block-diagonal causal mask of the packed rows (transformers' own mask functions, given
    the restarting position ids), for a decoder that would build its masks without them, so that every packed
    datum would attend to the datums before it (gpt-oss in transformers 5)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    arguments = dict(config=decoder.config, inputs_embeds=embeds, attention_mask=None, past_key_values=None,
                     position_ids=position_ids)
    return {"full_attention": create_causal_mask(**arguments),
            "sliding_attention": create_sliding_window_causal_mask(**arguments)}


@lru_cache(maxsize=None)
def _masks_ignore_positions(decoder_class: type) -> bool:
    """Whether this decoder class's forward takes ready masks by layer type (a dict) but builds its own without
    the position ids (transformers 5's idiom for both, read from its source)."""
    try:
        source = inspect.getsource(decoder_class.forward)
    except (OSError, TypeError):
        return False
    takes_masks = "isinstance(causal_mask_mapping := attention_mask, dict)" in source
    return takes_masks and '"position_ids": position_ids' not in source
