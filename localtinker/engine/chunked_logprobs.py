"""Hidden states → token logprobs on the portable path: the unembedding and the log-softmax a chunk of rows
at a time, recomputed in the backward, so no [tokens × vocab] float32 tensor outlives its chunk.

With autograd each chunk runs under activation checkpointing: the forward keeps only the chunk's hidden
states, and the backward recomputes its logits. Peak memory is one chunk's float32 logits and their
gradient (2048 × 128256 × 4 B ≈ 1 GB for Llama 3's vocabulary), whatever the batch. The same function
serves the trainer and the portable sampler (:func:`output_logits`), so their logprobs agree.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

LOGIT_CHUNK_TOKENS = 2048


def output_logits(hidden: torch.Tensor, lm_head: torch.nn.Module, softcap: float | None,
                  temperature: float = 1.0) -> torch.Tensor:
    """float32 logits of the model's distribution: the unembedding, then the final-logit soft cap
    (Gemma 2/3: ``cap·tanh(logits / cap)``), then the temperature."""
    logits = lm_head(hidden).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        logits = logits / temperature
    return logits


def _chunk_logprobs(hidden: torch.Tensor, targets: torch.Tensor, lm_head: torch.nn.Module, softcap: float | None,
                    temperature: float) -> torch.Tensor:
    logits = output_logits(hidden, lm_head, softcap, temperature)
    return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(dim=-1)


def chunked_token_logprobs(hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor,
                           softcap: float | None = None, temperature: float = 1.0,
                           chunk: int = LOGIT_CHUNK_TOKENS) -> torch.Tensor:
    """float32 logprob of ``targets[i]`` under the model's (temperature-scaled) distribution at ``hidden[i]``."""
    pieces = []
    for start in range(0, hidden.shape[0], chunk):
        rows, row_targets = hidden[start : start + chunk], targets[start : start + chunk]
        if torch.is_grad_enabled():
            pieces.append(checkpoint(_chunk_logprobs, rows, row_targets, lm_head, softcap, temperature,
                                     use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(rows, row_targets, lm_head, softcap, temperature))
    if not pieces:
        return torch.zeros((0,), dtype=torch.float32, device=hidden.device)
    return torch.cat(pieces)
