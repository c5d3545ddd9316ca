"""Check an exported model against the server: per-token logprobs of held-out prompts, plain transformers
vs ``SamplingClient.compute_logprobs`` on the checkpoint; the largest absolute difference is the figure."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import tinker
import torch
from tinker import types

# Prompts no recipe trains on: the figure measures the export, not the data.
VERIFY_PROMPTS = (
    "Explain in one sentence why the sky looks blue.",
    "Write a short poem about a lighthouse keeper.",
    "What is 17 multiplied by 23? Answer with the number.",
)


def prompt_tokens(tokenizer) -> list[list[int]]:
    """The prompts rendered with the tokenizer's chat template (a transformers tokenizer, duck-typed)."""
    rendered = []
    for prompt in VERIFY_PROMPTS:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tokenizer.encode(prompt)
        rendered.append(list(ids))
    return rendered


class ServerLogprobs:
    """The server's prompt logprobs, requested at once and collected later: the exporter loads its own models
    while the server answers."""

    def __init__(self, sampler: tinker.SamplingClient, prompts: list[list[int]]) -> None:
        self._futures: list[Future] = [sampler.compute_logprobs(types.ModelInput.from_ints(p)) for p in prompts]

    def result(self) -> list[np.ndarray]:
        return [np.array(f.result()[1:], dtype=np.float64) for f in self._futures]


def model_logprobs(model: torch.nn.Module, prompts: list[list[int]]) -> list[np.ndarray]:
    out = []
    with torch.no_grad():
        for tokens in prompts:
            logits = model(torch.tensor([tokens])).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
            out.append(logprobs.double().numpy())
    return out


def max_gap(ours: list[np.ndarray], theirs: list[np.ndarray]) -> float:
    return float(max(np.max(np.abs(a - b)) for a, b in zip(ours, theirs)))
