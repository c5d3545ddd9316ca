"""The portable trainer's forward: datums packed end to end into one padding-free row per micro-batch.

Each datum keeps its own positions (0, 1, ...) and attends only to itself: on CUDA the flash varlen kernel
takes the rows' boundaries (``cu_seq_lens``, portable_attention.py); elsewhere transformers reads the
restarting position ids as packed sequences and builds the block-diagonal causal mask. No token is padding,
so chat-like batches of 20- and 500-token rows cost their real tokens only.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from localtinker.engine.portable_attention import varlen_available, varlen_rows
from localtinker.engine.prefix_sharing import TokenRows


def packed_microbatches(lengths: list[int], budget: int) -> list[list[int]]:
    """Datum indices per micro-batch of at most ``budget`` tokens, in order; a longer datum runs alone."""
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, length in enumerate(lengths):
        if current and used + length > budget:
            batches.append(current)
            current, used = [], 0
        current.append(index)
        used += length
    if current:
        batches.append(current)
    return batches


def packed_token_rows(
    decoder: torch.nn.Module, tokens: list[torch.Tensor], targets: list[torch.Tensor], budget: int,
    device: torch.device,
) -> Iterator[TokenRows]:
    """Hidden states of every datum position, one packed micro-batch at a time (rows in datum order)."""
    for indices in packed_microbatches([t.shape[0] for t in tokens], budget):
        yield packed_rows(decoder, indices, tokens, targets, device)


def packed_rows(decoder: torch.nn.Module, indices: list[int], tokens: list[torch.Tensor],
                targets: list[torch.Tensor], device: torch.device) -> TokenRows:
    lengths = [tokens[i].shape[0] for i in indices]
    input_ids = torch.cat([tokens[i] for i in indices]).to(device, non_blocking=True)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).to(device, non_blocking=True)
    bounds = torch.tensor([0, *lengths]).cumsum(0)
    cu_seq_lens = bounds.to(device=device, dtype=torch.int32, non_blocking=True)
    longest = max(lengths)
    with varlen_rows(varlen_available(device)):
        hidden = decoder(
            input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False,
            cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=longest, max_length_k=longest,
        ).last_hidden_state[0]
    datum_rows = {
        index: torch.arange(int(bounds[k]), int(bounds[k + 1]), device=device) for k, index in enumerate(indices)
    }
    return TokenRows(hidden, torch.cat([targets[i] for i in indices]).to(device, non_blocking=True), datum_rows)
