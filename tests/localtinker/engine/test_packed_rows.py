"""packed_rows.py beyond what the family and portable-path tests reach: the GPU's micro-batch budget, which counts
an MoE's MLP once per expert a token goes through."""

from __future__ import annotations

import torch
from transformers import GptOssConfig, LlamaConfig

from localtinker.engine.packed_rows import device_microbatch_tokens

CEILING = 1 << 15


def test_the_gpu_budget_counts_each_expert_a_token_goes_through(monkeypatch):
    """With 80 GiB free: the Llama-3.1-8B shape takes 2048 tokens per micro-batch; gpt-oss-20b's shape (4 of 32
    experts per token) takes 4096, where counting its MLP once, as a dense model's, would give 8192, twice what
    its activations leave room for; the CPU keeps its own budget."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 80 << 30))
    cuda = torch.device("cuda")
    llama = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32)
    assert device_microbatch_tokens(llama, cuda, CEILING) == 2048
    gpt_oss = GptOssConfig(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_local_experts=32,
                           num_experts_per_tok=4)
    assert device_microbatch_tokens(gpt_oss, cuda, CEILING) == 4096
    gpt_oss.num_experts_per_tok = 0  # its MLP counted once
    assert device_microbatch_tokens(gpt_oss, cuda, CEILING) == 8192
    assert device_microbatch_tokens(llama, torch.device("cpu"), CEILING) == CEILING
