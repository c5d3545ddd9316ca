"""Per-row token choice on the logits' own device (the portable sampler's; the CPU path keeps sampler.py's).

The same rows as the CPU path (``sampler.SampleRow``: temperature, top-k, top-p, one seeded generator per
row), so a request's seed fixes its draws on either path: each step takes one uniform per row from the row's
generator, and the token is where it falls in the row's cumulative distribution. Logprobs are those of the
temperature-scaled, unfiltered distribution; temperature 0 is greedy with unscaled logprobs.
"""

from __future__ import annotations

import torch

from localtinker.engine.sampler import SampleRow


def choose_tokens_on_device(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [rows], their logprobs [rows]) on ``logits``' device; ``logits`` is float32 [rows, vocab]."""
    device, vocab = logits.device, logits.shape[-1]
    temperatures = [row.temperature if row.temperature > 0 else 1.0 for row in rows]
    if any(t != 1.0 for t in temperatures):
        logits = logits / torch.tensor(temperatures, device=device)[:, None]
    logprobs = logits.log_softmax(dim=-1)
    uniforms = torch.tensor(next_uniforms(rows), device=device)
    weights = _filtered(logprobs, rows).exp() if filters(rows, vocab) else logprobs.exp()
    tokens = draw(weights, uniforms)
    greedy = torch.tensor([row.temperature == 0 for row in rows], device=device)
    if bool(greedy.any()):
        tokens = torch.where(greedy, logprobs.argmax(dim=-1), tokens)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def next_uniforms(rows: list[SampleRow]) -> list[float]:
    """Each row's next draw from its own generator: one per row per step, whichever path decodes."""
    return [row.next_uniform() for row in rows]


def draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Where each row's uniform falls in its cumulative (unnormalised) distribution ``weights`` [rows, vocab].
    Shape-static and free of host synchronisation, so a CUDA graph can hold it (static_decode.py)."""
    cdf = weights.cumsum(dim=-1)
    tokens = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(-1)
    columns = torch.arange(weights.shape[-1], device=weights.device)
    last_positive = torch.where(weights > 0, columns, 0).amax(dim=-1)  # rounding at the top end
    return torch.minimum(tokens, last_positive)


def choose_in_step(logits: torch.Tensor, uniforms: torch.Tensor, temperatures: torch.Tensor,
                   greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, their logprobs) as :func:`choose_tokens_on_device` chooses them without top-k/top-p, from
    per-row tensors (uniform, temperature, 1 for greedy): shape-static and free of host synchronisation, for
    a decode step's graph (static_decode.py, which compiles it with the layer pieces on a GPU)."""
    logprobs = (logits / temperatures[:, None]).log_softmax(dim=-1)
    tokens = torch.where(greedy > 0, logprobs.argmax(dim=-1), draw(logprobs.exp(), uniforms))
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def filters(rows: list[SampleRow], vocab: int) -> bool:
    """Whether any row narrows its distribution (top-k or top-p)."""
    return any(0 < row.top_k < vocab or row.top_p < 1 for row in rows)


def _filtered(logprobs: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """``logprobs`` with -inf outside each row's top-k and top-p nucleus (the most likely token always stays)."""
    device, vocab = logprobs.device, logprobs.shape[-1]
    top_k = torch.tensor([row.top_k if 0 < row.top_k < vocab else vocab for row in rows], device=device)
    top_p = torch.tensor([row.top_p for row in rows], device=device)
    ordered, order = logprobs.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    probs = ordered.exp()
    before = probs.cumsum(dim=-1) - probs
    drop_sorted = (ranks >= top_k[:, None]) | ((before >= top_p[:, None]) & (ranks > 0))
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logprobs.masked_fill(drop, float("-inf"))
