"""Shared by the engine benches: a torch.mm peak measured in the same run, and a FLOP model of the work.

FLOP convention (stated so the figures can be checked): a forward pass costs 2 FLOPs per weight of
every linear layer (attention projections, MLP, unembedding) per token, plus attention's two
[query × keys] products, 4·d_model FLOPs per attended key per layer. A LoRA training step with frozen
base weights costs 2× its forward (the backward computes activation gradients only; the LoRA weight
gradients are negligible). Peak = the best of a few square float32 ``torch.mm`` runs on the same threads.
"""

from __future__ import annotations

import time

import torch


def mm_peak_gflops(size: int = 1024, repeats: int = 5) -> float:
    """Best GFLOP/s of a float32 [size × size] @ [size × size] on the current torch threads."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


class FlopModel:
    """Forward FLOPs of a Llama-style model from its config."""

    def __init__(self, config) -> None:
        d, layers = config.hidden_size, config.num_hidden_layers
        kv = d * config.num_key_value_heads // config.num_attention_heads
        self.body_weights = layers * (2 * d * d + 2 * d * kv + 3 * d * config.intermediate_size)
        self.unembedding_weights = d * config.vocab_size
        self.flops_per_attended_key = 4 * d * layers

    def forward(self, tokens: int, attended_keys: int, unembedded: int | None = None) -> float:
        """``tokens`` through the layers, ``attended_keys`` (query, key) pairs in all, ``unembedded``
        positions through the unembedding (default: every token)."""
        unembedded = tokens if unembedded is None else unembedded
        return (2 * self.body_weights * tokens + 2 * self.unembedding_weights * unembedded
                + self.flops_per_attended_key * attended_keys)

    def causal_keys(self, length: int) -> int:
        """(query, key) pairs of one causal sequence of ``length`` tokens."""
        return length * (length + 1) // 2


def report(flops: float, seconds: float, peak_gflops: float) -> str:
    achieved = flops / seconds / 1e9
    return f"{achieved:.1f} GFLOP/s = {100 * achieved / peak_gflops:.0f}% of the torch.mm peak ({peak_gflops:.1f} GFLOP/s)"
