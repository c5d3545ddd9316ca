"""Hidden states → token logprobs: the one code path shared by the trainer and the sampler.

Sharing it is what makes sampler logprobs equal trainer logprobs (float32: within 1e-6 in practice).
Logits are taken only for the positions asked for and reduced to ``logit[target] - logsumexp`` in
float32 chunk by chunk, so a [tokens × vocab] float32 log-softmax is never materialised.

A bf16-compute model's head (bf16_head.py) gives bf16 logits; each row's ``REFINED_TOKENS`` largest are
then recomputed exactly in float32 and replace the bf16 values, in the trainer (:class:`RefinedTargetLogprob`)
and in the sampler (:func:`next_token_logits`) alike.
"""

from __future__ import annotations

import torch

from localtinker.engine.bf16_head import REFINED_TOKENS, exact_logits_at, refines_logits

LOGIT_CHUNK_TOKENS = 1024


def token_logprobs(
    hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Logprob (float32) of ``targets[i]`` under softmax(lm_head(hidden[i]) / temperature), per row of ``hidden``."""
    pieces = []
    refined = refines_logits(lm_head)
    for start in range(0, hidden.shape[0], LOGIT_CHUNK_TOKENS):
        rows, row_targets = hidden[start : start + LOGIT_CHUNK_TOKENS], targets[start : start + LOGIT_CHUNK_TOKENS]
        if refined:
            logits = lm_head(rows)
            columns = _refined_columns(logits)
            exact = exact_logits_at(rows, lm_head, columns)
            pieces.append(RefinedTargetLogprob.apply(logits, exact, columns, row_targets, 1.0 / temperature))
            continue
        logits = lm_head(rows).float()
        if temperature != 1.0:
            logits = logits / temperature
        pieces.append(TargetLogprob.apply(logits, row_targets))
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


class RefinedTargetLogprob(torch.autograd.Function):
    """:class:`TargetLogprob` of the logits that are ``logits`` (bf16 [rows × vocab]) except at ``columns``
    [rows × K], where they are ``exact`` (float32 [rows × K]), all times ``inverse_temperature``.

    Never builds the float32 [rows × vocab] logits: the forward writes ``exp(logit − max)`` in float32
    straight from the bf16 logits (its one full-size buffer, zero at ``columns``), and the backward
    scales it into the bf16 logits' gradient in one pass; ``exact`` gets its own [rows × K] gradient.
    """

    @staticmethod
    def forward(ctx, logits, exact, columns, targets, inverse_temperature: float):
        exact = exact * inverse_temperature
        maxes = exact.amax(dim=-1, keepdim=True)  # the largest bf16 logits are among the columns
        if inverse_temperature == 1.0:
            weights = torch.sub(logits, maxes)  # bf16 - float32: a float32 result in one pass
        else:
            weights = logits.float().mul_(inverse_temperature).sub_(maxes)
        weights.exp_().scatter_(-1, columns, 0.0)
        exact_weights = (exact - maxes).exp_()
        totals = weights.sum(dim=-1) + exact_weights.sum(dim=-1)
        in_columns = columns == targets[:, None]
        refined_target = in_columns.any(dim=-1)
        target_logits = torch.where(
            refined_target,
            (exact * in_columns).sum(dim=-1),
            logits.gather(-1, targets[:, None]).squeeze(-1).float() * inverse_temperature,
        )
        ctx.save_for_backward(weights, exact_weights, totals, columns, targets, in_columns, refined_target)
        ctx.inverse_temperature = inverse_temperature
        return target_logits - (maxes.squeeze(-1) + totals.log())

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        weights, exact_weights, totals, columns, targets, in_columns, refined_target = ctx.saved_tensors
        scale = ctx.inverse_temperature
        share = (-grad_output * scale / totals)[:, None]
        grad_logits = torch.empty(weights.shape, dtype=torch.bfloat16)
        torch.mul(weights, share, out=grad_logits)  # zero at the columns: their gradient goes to exact
        own = torch.where(refined_target, 0.0, grad_output * scale).to(torch.bfloat16)
        grad_logits.scatter_add_(-1, targets[:, None], own[:, None])
        grad_exact = exact_weights * share + in_columns * (grad_output * scale)[:, None]
        return grad_logits, grad_exact, None, None, None


def next_token_logits(hidden_last: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
    """float32 logits [rows, vocab] for sampling: the function :func:`token_logprobs` reduces."""
    logits = lm_head(hidden_last)
    if not refines_logits(lm_head):
        return logits.float()
    columns = _refined_columns(logits)
    return logits.float().scatter_(-1, columns, exact_logits_at(hidden_last, lm_head, columns))


def _refined_columns(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the token ids of the ``REFINED_TOKENS`` largest logits (all, for a smaller vocabulary)."""
    return logits.detach().topk(min(REFINED_TOKENS, logits.shape[-1]), dim=-1, sorted=False).indices
