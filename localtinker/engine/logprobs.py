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
        pieces.append(TargetLogprob.apply(logits, targets[start : start + LOGIT_CHUNK_TOKENS]))
    if not pieces:
        return hidden.new_zeros((0,), dtype=torch.float32)
    return torch.cat(pieces)


def token_logprobs_tracking(
    hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, tracked: torch.Tensor
) -> torch.Tensor:
    """:func:`token_logprobs` with autograd only through the rows where ``tracked`` (bool [rows]) is set.

    The other rows' logprobs are computed without a graph: the caller guarantees their gradient is
    exactly zero (``losses.gradient_tokens``), so the result and every gradient are the same function.
    What is saved is their share of the unembedding's backward — a [rows × vocab] × [vocab × hidden]
    product, the softmax gradient pass and its saved [rows × vocab] buffer — which on SmolLM2-135M is
    ~20% of a token's backward: the prompt of an RL sample or a chat SFT row costs a forward only there.
    At least one row stays tracked, so an all-zero batch still back-propagates (zero) gradients and
    Adam sees a zero gradient rather than none.
    """
    if not torch.is_grad_enabled() or bool(tracked.all()):
        return token_logprobs(hidden, lm_head, targets)
    if not bool(tracked.any()):
        tracked = tracked.clone()
        tracked[0] = True
    tracked_rows = tracked.nonzero().squeeze(1)
    other_rows = (~tracked).nonzero().squeeze(1)
    with torch.no_grad():
        other = token_logprobs(hidden[other_rows], lm_head, targets[other_rows])
    own = token_logprobs(hidden[tracked_rows], lm_head, targets[tracked_rows])
    return torch.cat([own, other])[torch.argsort(torch.cat([tracked_rows, other_rows]))]


class TargetLogprob(torch.autograd.Function):
    """``logits[i, t_i] − logsumexp(logits[i])`` with a one-pass backward, ``g·(onehot − softmax)``.

    Autograd's version of the same expression zero-fills a [tokens × vocab] buffer for the gather, then
    adds the log-sum-exp gradient in further full passes; on the 49k-token vocabulary that was ~10% of
    a LoRA SFT step. Here the forward makes one [tokens × vocab] buffer, ``exp(logits − max)``, which
    the backward scales into the gradient in one pass; each fresh buffer of that size costs a
    page-faulting allocation as well as its pass.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        maxes = logits.amax(dim=-1, keepdim=True)
        weights = (logits - maxes).exp_()
        totals = weights.sum(dim=-1)
        ctx.save_for_backward(weights, totals, targets)
        return logits.gather(-1, targets[:, None]).squeeze(-1) - (maxes.squeeze(-1) + totals.log())

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        weights, totals, targets = ctx.saved_tensors
        grad = weights * (-grad_output / totals)[:, None]  # not in place: the graph may be retained
        grad.scatter_add_(-1, targets[:, None], grad_output[:, None])
        return grad, None


def next_token_logits(hidden_last: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
    """float32 logits [rows, vocab] for sampling; same lm_head call as :func:`token_logprobs`."""
    return lm_head(hidden_last).float()
