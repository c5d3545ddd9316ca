"""Packed frozen linears: used only while sampling without autograd, never for LoRA factors, same function."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import localtinker.engine.packed_linear as packed_linear
from localtinker.engine.api import LoraSpec
from localtinker.engine.lora import AdapterHost
from localtinker.engine.models import tiny_random_dir

pytestmark = pytest.mark.skipif(not packed_linear.packing_available(), reason="this torch build has no oneDNN")


def _frozen_tiny_model() -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(tiny_random_dir(), dtype=torch.float32).eval()
    model.requires_grad_(False)
    return model


def _packed(module: torch.nn.Module) -> torch.Tensor | None:
    return getattr(module, "_localtinker_packed", None)


def test_packed_path_is_taken_only_inside_packed_sampling_without_autograd():
    model = _frozen_tiny_model()
    head = model.get_output_embeddings()
    plain = head.weight.detach().clone()
    packed_linear.pack_frozen_linears(model, measure=False)
    assert _packed(head) is not None
    # Re-pack the head from other weights: only calls that take the packed path see them.
    other = torch.randn_like(plain)
    head._localtinker_packed = packed_linear.pack_weight(other)
    x = torch.randn(5, plain.shape[1])
    with torch.inference_mode():
        assert torch.equal(head(x), torch.nn.functional.linear(x, plain))
        with packed_linear.packed_sampling():
            torch.testing.assert_close(head(x), torch.nn.functional.linear(x, other), rtol=1e-4, atol=1e-4)
        assert torch.equal(head(x), torch.nn.functional.linear(x, plain))  # the block restored the state
    with packed_linear.packed_sampling():
        needs_grad = x.clone().requires_grad_()
        out = head(needs_grad)  # autograd on: the plain kernel, which has a backward
        assert torch.equal(out.detach(), torch.nn.functional.linear(x, plain))
        out.sum().backward()
        assert needs_grad.grad is not None


def test_packed_kernel_computes_the_same_function_and_is_batch_invariant():
    model = _frozen_tiny_model()
    tokens = torch.randint(0, model.config.vocab_size, (6, 9))
    with torch.inference_mode():
        expected = model(input_ids=tokens).logits
        packed_linear.pack_frozen_linears(model, measure=False)
        with packed_linear.packed_sampling():
            together = model(input_ids=tokens).logits
            alone = torch.cat([model(input_ids=tokens[i : i + 1]).logits for i in range(len(tokens))])
    torch.testing.assert_close(together, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(alone, together)  # a row's logits do not depend on the rows beside it


def test_lora_factors_are_never_packed_and_adapter_changes_reach_sampling():
    model = _frozen_tiny_model()
    host = AdapterHost(model)
    name = host.add_adapter(LoraSpec(rank=4, train_attn=True, train_mlp=True, train_unembed=True), seed=0)
    choices = packed_linear.pack_frozen_linears(model, measure=False)
    assert choices and all(choices.values())
    packed = {path for path, module in model.named_modules() if _packed(module) is not None}
    assert packed and not [path for path in packed if "lora_" in path]
    assert all(".base_layer" in path or path.endswith("lm_head") for path in packed), sorted(packed)[:5]
    tokens = torch.randint(0, model.config.vocab_size, (2, 7))

    def sampled_logits() -> torch.Tensor:
        with torch.inference_mode(), host.activated(name), packed_linear.packed_sampling():
            return model(input_ids=tokens).logits

    before = sampled_logits()
    with torch.no_grad():
        for key, param in host.parameters(name).items():
            if "lora_B" in key:
                param.add_(0.1)
    assert not torch.allclose(sampled_logits(), before)
    assert packed_linear.pack_frozen_linears(model) is choices  # once per model


def test_measured_choice_packs_nothing_when_the_kernel_never_wins(monkeypatch):
    monkeypatch.setattr(packed_linear, "_packed_wins", lambda weight: False)
    model = _frozen_tiny_model()
    choices = packed_linear.pack_frozen_linears(model)
    assert choices and not any(choices.values())
    assert not [path for path, module in model.named_modules() if _packed(module) is not None]


@pytest.mark.skipif(not packed_linear.packing_available(torch.bfloat16), reason="oneDNN has no bf16 kernels on this CPU")
def test_bf16_weights_are_packed_where_bf16_computes_natively(monkeypatch):
    from localtinker.engine.bf16_matmul import ENV_CHOICE, bf16_matmul_is_fast

    monkeypatch.setenv(ENV_CHOICE, "bfloat16")
    bf16_matmul_is_fast.cache_clear()
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_random_dir(), dtype=torch.bfloat16).eval()
        model.requires_grad_(False)
        tokens = torch.randint(0, model.config.vocab_size, (5, 8))
        with torch.inference_mode():
            expected = model(input_ids=tokens).logits
            choices = packed_linear.pack_frozen_linears(model, measure=False)
            with packed_linear.packed_sampling():
                together = model(input_ids=tokens).logits
                alone = torch.cat([model(input_ids=tokens[i : i + 1]).logits for i in range(len(tokens))])
    finally:
        bf16_matmul_is_fast.cache_clear()
    up_proj = model.get_decoder().layers[0].mlp.up_proj
    assert choices and all(choices.values()) and _packed(up_proj) is not None
    assert together.dtype == torch.bfloat16
    torch.testing.assert_close(together.float(), expected.float(), rtol=0.02, atol=0.05)  # bf16 rounding
    assert torch.equal(alone, together)


def test_a_float32_model_never_measures_bf16(monkeypatch):
    def measured() -> bool:
        raise AssertionError("a float32 model must not run the bf16 measurement (slow where bf16 is emulated)")

    monkeypatch.setattr(packed_linear, "bf16_matmul_is_fast", measured)
    assert packed_linear.packable_dtypes(_frozen_tiny_model()) == (torch.float32,)
    assert packed_linear.pack_frozen_linears(_frozen_tiny_model(), measure=False)
