"""Hidden states → token logprobs: the one code path shared by the trainer and the sampler.

Sharing it is what makes sampler logprobs equal trainer logprobs (float32: within 1e-6 in practice).
Logits are taken only for the positions asked for and reduced to ``logit[target] - logsumexp`` in
float32 chunk by chunk, so a [tokens × vocab] float32 log-softmax is never materialised.
"""

from __future__ import annotations

import torch

LOGIT_CHUNK_TOKENS = 1024


def token_logprobs(
    hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Logprob (float32) of ``targets[i]`` under softmax(lm_head(hidden[i]) / temperature), per row of ``hidden``."""
    pieces = []
    for start in range(0, hidden.shape[0], LOGIT_CHUNK_TOKENS):
        logits = lm_head(hidden[start : start + LOGIT_CHUNK_TOKENS]).float()
        if temperature != 1.0:
            logits = logits / temperature
        chosen = logits.gather(-1, targets[start : start + LOGIT_CHUNK_TOKENS, None]).squeeze(-1)
        pieces.append(chosen - torch.logsumexp(logits, dim=-1))
    if not pieces:
        return hidden.new_zeros((0,), dtype=torch.float32)
    return torch.cat(pieces)


def next_token_logits(hidden_last: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
    """float32 logits [rows, vocab] for sampling; same lm_head call as :func:`token_logprobs`."""
    return lm_head(hidden_last).float()
