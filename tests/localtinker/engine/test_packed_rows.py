"""packed_rows.py beyond what the family and portable-path tests reach: the GPU's micro-batch budget, which counts
an MoE's MLP once per expert a token goes through, and which models' packed rows take the flash varlen kernel."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GptOssConfig, LlamaConfig

from localtinker.engine.packed_rows import device_microbatch_tokens, takes_varlen
from tests.localtinker.engine.families import family_dir

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


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
def test_packed_rows_take_flash_varlen_on_cuda_in_half_dtypes_without_caps_or_sinks(family):
    """flash varlen (on a CUDA device: the decision reads only its type) takes bf16/fp16 rows of a model without a
    soft cap on its attention scores (Gemma 2) or attention sinks (gpt-oss), which the kernel lacks; never float32
    (flash has none) nor the CPU."""
    model = AutoModelForCausalLM.from_pretrained(family_dir(family), dtype=torch.float32)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert not takes_varlen(model.get_decoder(), cuda)
    model.to(torch.bfloat16)
    assert takes_varlen(model.get_decoder(), cuda) == (family == "llama")
    assert not takes_varlen(model.get_decoder(), cpu)
