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
def test_packed_rows_go_by_their_bounds_on_flash_in_half_dtypes_and_with_sinks_or_caps_anywhere(family, monkeypatch):
    """Without a [tokens × tokens] mask: a plain model's rows through flash varlen (on a CUDA card from sm80: the
    decision reads the device's type and the card's compute capability, faked here) in bf16/fp16, never float32
    (flash has none), on an older card or on the CPU; rows of a model with a soft cap on its scores (Gemma 2) or
    attention sinks (gpt-oss) through beyond_flash.py, on any device and dtype."""
    capability = {"now": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["now"])
    model = AutoModelForCausalLM.from_pretrained(family_dir(family), dtype=torch.float32)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    beyond = family != "llama"
    assert takes_varlen(model.get_decoder(), cuda) == beyond
    assert takes_varlen(model.get_decoder(), cpu) == beyond
    model.to(torch.bfloat16)
    assert takes_varlen(model.get_decoder(), cuda)
    assert takes_varlen(model.get_decoder(), cpu) == beyond
    capability["now"] = (7, 5)  # a T4: no flash kernels
    assert takes_varlen(model.get_decoder(), cuda) == beyond
