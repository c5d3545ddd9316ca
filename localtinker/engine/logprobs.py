"""Hidden states → token logprobs: the one code path shared by the trainer and the sampler.

Sharing it is what makes sampler logprobs equal trainer logprobs (float32: within 1e-6 in practice).
Logits are taken only for the positions asked for and reduced to ``logit[target] - logsumexp`` in
float32 chunk by chunk, so a [tokens × vocab] float32 log-softmax is never materialised.

A bf16-compute model's head (bf16_head.py) gives bf16 logits; each row's ``REFINED_TOKENS`` largest are
then recomputed exactly in float32 and replace the bf16 values, in the trainer (:class:`RefinedTargetLogprob`)
and in the sampler (:func:`next_token_logits`) alike.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from localtinker.engine.bf16_head import REFINED_TOKENS, exact_logits_at, refines_logits
from localtinker.engine.fast_exp import exp_

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
    a large share of a token's backward: the prompt of an RL sample or a chat SFT row costs a forward only there.
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
    adds the log-sum-exp gradient in further full passes; on the 49k-token vocabulary that was a visible share of
    a LoRA SFT step. Here ``exp(logits − max)`` is made a few rows at a time (:func:`_shifted_exp_rows`)
    in the forward, for the sums, and again in the backward, scaled straight into the gradient.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        maxes = logits.amax(dim=-1, keepdim=True)
        totals = _shifted_exp_sums(logits, maxes, 1.0, None)
        ctx.save_for_backward(logits, maxes, totals, targets)
        return logits.gather(-1, targets[:, None]).squeeze(-1) - (maxes.squeeze(-1) + totals.log())

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        logits, maxes, totals, targets = ctx.saved_tensors
        grad = _scaled_shifted_exp(logits, maxes, 1.0, None, (-grad_output / totals)[:, None], logits.dtype)
        grad.scatter_add_(-1, targets[:, None], grad_output[:, None])
        return grad, None


class RefinedTargetLogprob(torch.autograd.Function):
    """:class:`TargetLogprob` of the logits that are ``logits`` (bf16 [rows × vocab]) except at ``columns``
    [rows × K], where they are ``exact`` (float32 [rows × K]), all times ``inverse_temperature``.

    Never builds the float32 [rows × vocab] logits: ``exp(logit − max)``, zero at ``columns``, is made in
    float32 from the bf16 logits a few rows at a time, summed in the forward and scaled into the bf16
    logits' gradient in the backward; ``exact`` gets its own [rows × K] gradient.
    """

    @staticmethod
    def forward(ctx, logits, exact, columns, targets, inverse_temperature: float):
        exact = exact * inverse_temperature
        maxes = exact.amax(dim=-1, keepdim=True)  # the largest bf16 logits are among the columns
        exact_weights = exp_(exact - maxes)
        totals = _shifted_exp_sums(logits, maxes, inverse_temperature, columns) + exact_weights.sum(dim=-1)
        in_columns = columns == targets[:, None]
        refined_target = in_columns.any(dim=-1)
        target_logits = torch.where(
            refined_target,
            (exact * in_columns).sum(dim=-1),
            logits.gather(-1, targets[:, None]).squeeze(-1).float() * inverse_temperature,
        )
        ctx.save_for_backward(logits, maxes, exact_weights, totals, columns, targets, in_columns, refined_target)
        ctx.inverse_temperature = inverse_temperature
        return target_logits - (maxes.squeeze(-1) + totals.log())

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        logits, maxes, exact_weights, totals, columns, targets, in_columns, refined_target = ctx.saved_tensors
        scale = ctx.inverse_temperature
        share = (-grad_output * scale / totals)[:, None]
        # zero at the columns: their gradient goes to exact
        grad_logits = _scaled_shifted_exp(logits, maxes, scale, columns, share, torch.bfloat16)
        own = torch.where(refined_target, 0.0, grad_output * scale).to(torch.bfloat16)
        # One element per row, so an indexed add: a bf16 scatter_add_ adds through a float32 copy of the
        # whole [rows × vocab] gradient; the sums are the same.
        rows = torch.arange(len(targets))
        grad_logits[rows, targets] += own
        grad_exact = exact_weights * share + in_columns * (grad_output * scale)[:, None]
        return grad_logits, grad_exact, None, None, None


# Rows of exp(logits − max) made at a time: 16 × 49152 float32 is 3 MB, which stays in cache between the
# passes over it, and nothing of that size is kept for the backward but the logits (bf16 for a bf16 model:
# half of the float32 buffer kept before). Bit for bit the values of whole-tensor passes; mostly a memory
# saving (bench/bench_engine_train.py; docs/engine-notes.md, large temporaries).
_ROWS_PER_PASS = 16


def _shifted_exp_rows(logits: torch.Tensor, maxes: torch.Tensor, inverse_temperature: float,
                      columns: torch.Tensor | None) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(start, stop, exp(logits[start:stop]·t − max) in float32 (float64 logits: float64), zero at ``columns``),
    a few rows at a time in one reused buffer: overwritten by the next."""
    buffer = torch.empty((min(_ROWS_PER_PASS, logits.shape[0]), logits.shape[1]), dtype=_computed(logits))
    for start in range(0, logits.shape[0], _ROWS_PER_PASS):
        stop = min(start + _ROWS_PER_PASS, logits.shape[0])
        rows = buffer[: stop - start].copy_(logits[start:stop])
        if inverse_temperature != 1.0:
            rows.mul_(inverse_temperature)
        exp_(rows.sub_(maxes[start:stop]))
        if columns is not None:
            rows.scatter_(-1, columns[start:stop], 0.0)
        yield start, stop, rows


def _shifted_exp_sums(logits: torch.Tensor, maxes: torch.Tensor, inverse_temperature: float,
                      columns: torch.Tensor | None) -> torch.Tensor:
    totals = torch.empty(logits.shape[0], dtype=_computed(logits))
    for start, stop, rows in _shifted_exp_rows(logits, maxes, inverse_temperature, columns):
        torch.sum(rows, dim=-1, out=totals[start:stop])
    return totals


def _computed(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def _scaled_shifted_exp(logits: torch.Tensor, maxes: torch.Tensor, inverse_temperature: float,
                        columns: torch.Tensor | None, share: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """exp(logits·t − max) · share [rows × 1], zero at ``columns``, as a new ``dtype`` tensor."""
    result = torch.empty(logits.shape, dtype=dtype)
    for start, stop, rows in _shifted_exp_rows(logits, maxes, inverse_temperature, columns):
        result[start:stop].copy_(rows.mul_(share[start:stop]))
    return result


def next_token_logits(hidden_last: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
    """float32 logits [rows, vocab] for sampling: the function :func:`token_logprobs` reduces."""
    logits = lm_head(hidden_last)
    if logits.dtype == torch.float32 and not refines_logits(lm_head):
        return logits
    return _as_float_logits(logits, hidden_last, lm_head, torch.empty(logits.shape, dtype=torch.float32))


# A decode step takes the next-token logits of its rows this many at a time (:func:`next_token_logit_blocks`).
SAMPLING_BLOCK_ROWS = 32
SELECTION_BLOCK = 128  # vocabulary columns per block when choosing the logits a bf16 head refines (_refined_columns)


def next_token_logit_blocks(
    hidden_last: torch.Tensor, lm_head: torch.nn.Module, block_rows: int = SAMPLING_BLOCK_ROWS
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """:func:`next_token_logits` as (start, stop, float32 logits of rows start:stop), ``block_rows`` at a
    time, each block the caller's to overwrite until the next one is asked for.

    The unembedding runs once over all rows (its weight is read once); the rest is per block in one
    reused buffer: the float32 copy of bf16 logits, the refinement, and the caller's token choice (max,
    exp, sums) then pass over [32 × 49152] in cache instead of [rows × 49152] in memory, and no
    [rows × vocab] float32 buffer exists (100 MB at 512 rows). Per-row values are those of
    :func:`next_token_logits`, bit for bit (tested). A small gain (RL-shaped sampling,
    bench/bench_rl_sampling.py; docs/engine-notes.md, large temporaries).
    """
    logits = lm_head(hidden_last)
    convert = logits.dtype != torch.float32 or refines_logits(lm_head)
    buffer = torch.empty((min(block_rows, logits.shape[0]), logits.shape[-1]), dtype=torch.float32) if convert else None
    for start in range(0, logits.shape[0], block_rows):
        stop = min(start + block_rows, logits.shape[0])
        if buffer is None:  # float32 logits of a plain head are already the values, and the caller's
            yield start, stop, logits[start:stop]
        else:
            out = buffer[: stop - start]
            yield start, stop, _as_float_logits(logits[start:stop], hidden_last[start:stop], lm_head, out)


def _as_float_logits(logits: torch.Tensor, hidden: torch.Tensor, lm_head: torch.nn.Module,
                     out: torch.Tensor) -> torch.Tensor:
    """``out`` (float32, ``logits``' shape) ← ``logits``, with each row's ``REFINED_TOKENS`` largest
    recomputed exactly when ``lm_head`` refines."""
    out.copy_(logits)
    if refines_logits(lm_head):
        columns = _refined_columns(out)  # the same values as the bf16 logits, compared in float32 either way
        out.scatter_(-1, columns, exact_logits_at(hidden, lm_head, columns))
    return out


def _refined_columns(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the token ids of the ``REFINED_TOKENS`` largest logits (all, for a smaller vocabulary).

    Selected by blocks of :data:`SELECTION_BLOCK` columns: a row's K largest lie in the K blocks whose
    maxima are largest (a value outside them is at most its own block's maximum, which is at most each of
    those K maxima), so a top-K over the block maxima, then one over those K blocks' columns, finds them.
    About twice as fast as ``torch.topk`` over whole rows (docs/engine-notes.md, after Pass 8). Values are compared
    in float32, 32 rows at a time: the sampler passes its float32 copy of the bf16 logits, the trainer
    its bf16 logits, so both select on the same numbers, by the same steps. Among values tied at the
    K-th place either may be taken, as with ``torch.topk``; a row's choice never depends on other rows.
    """
    rows, vocab = logits.shape
    count = min(REFINED_TOKENS, vocab)
    blocks, ragged = divmod(vocab, SELECTION_BLOCK)
    if ragged or blocks < 4 * count:  # not in whole blocks, or too few to skip many: a top-k over each row
        return logits.detach().float().topk(count, dim=-1, sorted=False).indices
    logits = logits.detach()
    chosen = torch.empty((rows, count), dtype=torch.long)
    offsets = torch.arange(SELECTION_BLOCK)
    values = None if logits.dtype == torch.float32 else torch.empty((min(rows, SAMPLING_BLOCK_ROWS), vocab))
    for start in range(0, rows, SAMPLING_BLOCK_ROWS):
        part = logits[start : start + SAMPLING_BLOCK_ROWS]
        if values is not None:
            part = values[: len(part)].copy_(part)
        maxima = part.reshape(len(part), blocks, SELECTION_BLOCK).amax(dim=-1)
        best = maxima.topk(count, dim=-1, sorted=False).indices
        columns = (best[:, :, None] * SELECTION_BLOCK + offsets).view(len(part), -1)
        within = part.gather(-1, columns).topk(count, dim=-1, sorted=False).indices
        chosen[start : start + len(part)] = columns.gather(-1, within)
    return chosen
