"""Logprob figures beyond the sampled tokens': top-k per prompt or sampled position, the logprobs of
given target ids at each prompt position, and independent alternative draws per prompt position.

Computed after sampling by one teacher-forced pass per sequence over prompt + sampled tokens, with the
sampler's weights active, at the request's temperature: the distribution the sampled logprobs come from.
A separate pass keeps the sampler's decode loop unchanged; these options are for distillation and
analysis, where a second forward is cheap next to the teacher's work.
"""

from __future__ import annotations

import numpy as np
import torch

from localtinker.engine.api import (
    TOPK_MASK,
    EngineUserError,
    SampleExtras,
    SampleExtrasSpec,
    SampleResult,
    SampleSpec,
    TopK,
)
from localtinker.engine.sample_stream import SamplingTarget


def next_token_logprobs(target: SamplingTarget, tokens: list[int], temperature: float) -> torch.Tensor:
    """float32 [len(tokens), vocab]: row i is the temperature-scaled distribution of token i + 1."""
    with torch.no_grad(), target.activate():
        device = next(target.model.parameters()).device  # the engine's device (CPU or CUDA path)
        logits = target.model(input_ids=torch.tensor([tokens], dtype=torch.long, device=device)).logits[0].float()
    return torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1).cpu()


def _topk(rows: torch.Tensor, k: int, masked_first: bool) -> TopK:
    k = min(k, rows.shape[-1])
    values, ids = torch.topk(rows, k, dim=-1)
    token_ids, logprobs = ids.to(torch.int32).numpy(), values.numpy().astype(np.float32)
    if masked_first:
        token_ids = np.concatenate([np.zeros((1, k), np.int32), token_ids])
        logprobs = np.concatenate([np.full((1, k), TOPK_MASK, np.float32), logprobs])
    return TopK(token_ids=token_ids, logprobs=logprobs)


def _target_logprobs(prompt_rows: torch.Tensor, targets: np.ndarray) -> np.ndarray:
    """``targets[i, j]`` scored at prompt position i + 1 (row i of ``prompt_rows``); 0.0 where it is -1."""
    if targets.ndim != 2 or targets.shape[0] != prompt_rows.shape[0]:
        raise EngineUserError(
            f"target_prompt_logprobs must have shape [len(prompt) - 1, K] = [{prompt_rows.shape[0]}, K], "
            f"got {list(targets.shape)}"
        )
    vocab = prompt_rows.shape[-1]
    if ((targets < -1) | (targets >= vocab)).any():
        raise EngineUserError(f"target_prompt_logprobs holds ids outside the vocabulary [0, {vocab}) (or -1 for none)")
    wanted = torch.from_numpy(np.where(targets < 0, 0, targets).astype(np.int64))
    scored = prompt_rows.gather(1, wanted).numpy().astype(np.float32)
    return np.where(targets < 0, np.float32(0.0), scored)


def _alt_tokens(prompt_rows: torch.Tensor, k: int, seed: int | None) -> tuple[np.ndarray, np.ndarray]:
    generator = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item()))
    draws = torch.multinomial(prompt_rows.exp(), k, replacement=True, generator=generator)
    return draws.numpy().astype(np.int64), prompt_rows.gather(1, draws).numpy().astype(np.float32)


def sample_extras(target: SamplingTarget, spec: SampleSpec, extras: SampleExtrasSpec, result: SampleResult) -> SampleExtras:
    prompt = list(spec.prompt_tokens)
    out = SampleExtras()
    if extras.topk_sample_logprobs:
        out.topk_sample = []
        for sequence in result.sequences:
            if not sequence.tokens:
                out.topk_sample.append(_topk(torch.zeros(0, 1), 1, masked_first=False))
                continue
            rows = next_token_logprobs(target, prompt + sequence.tokens[:-1], spec.temperature)
            out.topk_sample.append(_topk(rows[len(prompt) - 1 :], extras.topk_sample_logprobs, masked_first=False))
    needs_prompt = extras.topk_prompt_logprobs or extras.prompt_alt_tokens_k or extras.target_prompt_logprobs is not None
    if needs_prompt and len(prompt) > 1:
        prompt_rows = next_token_logprobs(target, prompt, spec.temperature)[:-1]
        if extras.topk_prompt_logprobs:
            out.topk_prompt = _topk(prompt_rows, extras.topk_prompt_logprobs, masked_first=True)
        if extras.target_prompt_logprobs is not None:
            out.target_prompt = _target_logprobs(prompt_rows, extras.target_prompt_logprobs)
        if extras.prompt_alt_tokens_k:
            out.prompt_alt_tokens = _alt_tokens(prompt_rows, extras.prompt_alt_tokens_k, spec.seed)
    return out
