"""Check an exported model against the server: per-token logprobs of held-out prompts, plain transformers
vs ``SamplingClient.compute_logprobs`` on the checkpoint; the largest absolute difference is the figure."""

from __future__ import annotations

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
    rendered = []
    for prompt in VERIFY_PROMPTS:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tokenizer.encode(prompt)
        rendered.append(list(ids))
    return rendered


def server_logprobs(sampler: tinker.SamplingClient, prompts: list[list[int]]) -> list[np.ndarray]:
    futures = [sampler.compute_logprobs(types.ModelInput.from_ints(p)) for p in prompts]
    return [np.array(f.result()[1:], dtype=np.float64) for f in futures]


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
