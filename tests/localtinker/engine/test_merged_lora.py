"""A sampler adapter folded into its base weights: same function, used only while sampling, bounded copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import localtinker.engine.engine as engine_module
import localtinker.engine.merged_lora as merged_lora
from localtinker.engine.api import AdamSpec, DatumArrays, LoraSpec, SampleSpec
from localtinker.engine.packed_linear import pack_frozen_linears, packed_sampling, packing_available
from tests.localtinker.engine.reference import TINY, host_with_random_b, sft_datum


def _logits(host, name, tokens: torch.Tensor) -> torch.Tensor:
    with host.activated(name):
        return host.model(input_ids=tokens).logits


def test_merged_weights_compute_the_adapters_function_and_serve_only_sampling_without_autograd():
    host, name = host_with_random_b()
    host.model.requires_grad_(False)
    tokens = torch.randint(0, host.model.config.vocab_size, (3, 7))
    with torch.inference_mode():
        unmerged = _logits(host, name, tokens)
        with packed_sampling():
            unmerged_sampling = _logits(host, name, tokens)
    assert merged_lora.mergeable(host.model, name)
    merged_lora.merge(host.model, name)
    assert merged_lora.is_merged(host.model, name)
    with torch.inference_mode(), packed_sampling():
        torch.testing.assert_close(_logits(host, name, tokens), unmerged_sampling, rtol=1e-5, atol=1e-5)
    # Zero the adapter's B: only a path that reads the merged copies still sees the old adapter.
    with torch.no_grad():
        for key, param in host.parameters(name).items():
            if "lora_B" in key:
                param.zero_()
    with torch.inference_mode():
        outside = _logits(host, name, tokens)  # not sampling: the live (now zero) adapter
        with packed_sampling():
            inside = _logits(host, name, tokens)
    assert not torch.allclose(outside, unmerged, atol=1e-3)
    torch.testing.assert_close(inside, unmerged_sampling, rtol=1e-5, atol=1e-5)
    with packed_sampling():
        assert not torch.allclose(_logits(host, name, tokens).detach(), unmerged, atol=1e-3)  # autograd on: live adapter


def _buffer(layer, name) -> int:
    """Where the layer's W' of adapter ``name`` was computed: the kept W', or (packed layers) the kept buffer."""
    weight, _ = layer._localtinker_merged[name]
    return (weight if weight is not None else layer._localtinker_merge_spare).data_ptr()


@pytest.mark.parametrize(
    "packed",
    [False, pytest.param(True, marks=pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN"))],
)
def test_unmerge_drops_the_copies_and_the_next_merge_reuses_their_buffers(packed):
    host, name = host_with_random_b()
    if packed:
        pack_frozen_linears(host.model, measure=False)
    else:
        host.model._localtinker_packing_choices = {}  # as if no shape had measured faster packed
    merged_lora.merge(host.model, name)
    layer = next(m for m in host.model.modules() if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict))
    weight, packed_weight = layer._localtinker_merged[name]
    assert (weight is None, packed_weight is not None) == (packed, packed)  # one copy per layer, not two
    first = _buffer(layer, name)
    merged_lora.unmerge(host.model, name)
    assert not merged_lora.is_merged(host.model, name)
    other = host.add_adapter(LoraSpec(rank=4, train_attn=True, train_mlp=True, train_unembed=True), seed=5)
    merged_lora.merge(host.model, other)
    assert _buffer(layer, other) == first  # no fresh pages for an RL loop's next snapshot
    host.delete_adapter(other)
    assert other not in layer.__dict__.get("_localtinker_merged", {})


@pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")
def test_a_merged_weight_follows_its_base_layer_into_the_packed_kernel():
    host, name = host_with_random_b()
    host.model.requires_grad_(False)
    tokens = torch.randint(0, host.model.config.vocab_size, (2, 5))
    with torch.inference_mode(), packed_sampling():
        expected = _logits(host, name, tokens)
    pack_frozen_linears(host.model, measure=False)
    merged_lora.merge(host.model, name)
    layers = [m for m in host.model.modules() if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)]
    assert all(layer._localtinker_merged[name][1] is not None for layer in layers)
    with torch.inference_mode(), packed_sampling():
        torch.testing.assert_close(_logits(host, name, tokens), expected, rtol=1e-4, atol=1e-4)


def test_bfloat16_adapters_are_not_merged():
    host, name = host_with_random_b()
    host.model.to(torch.bfloat16)
    assert not merged_lora.mergeable(host.model, name)


def _trained_sampler(engine, new_id, sampler_id: str, steps: int) -> str:
    model_id = new_id()
    engine.create_model(model_id, TINY, LoraSpec(rank=4, seed=steps))
    rng = np.random.default_rng(steps)
    for _ in range(steps):
        engine.forward_backward(model_id, [sft_datum(rng, 12)], "cross_entropy", None, False)
        engine.optim_step(model_id, AdamSpec(learning_rate=0.05))
    engine.create_ephemeral_sampler(sampler_id, model_id)
    return model_id


def test_engine_samples_through_at_most_two_merged_adapters_and_scores_like_the_trainer(engine, new_id, monkeypatch):
    monkeypatch.setattr(engine_module, "RESIDENT_SAMPLER_ADAPTERS", 4)  # more resident adapters than merge slots
    host = engine._hosts.get(TINY) or engine._host(TINY)
    prompt = tuple(range(300, 310))
    for index in range(3):
        model_id = _trained_sampler(engine, new_id, f"merged-{index}", steps=index + 1)
        spec = SampleSpec(prompt_tokens=prompt, max_tokens=5, seed=index, stop_token_ids=())
        result = engine.sample_batch([(f"merged-{index}", spec)])[0].sequences[0]
        adapter = host.resident[engine._sampler(f"merged-{index}").weights_key]
        assert merged_lora.is_merged(host.base.model, adapter)
        assert len(host.merged) <= engine_module.MERGED_SAMPLER_ADAPTERS
        full = list(prompt) + result.tokens
        datum = DatumArrays(
            tokens=np.array(full[:-1]),
            loss_fn_inputs={"target_tokens": np.array(full[1:]), "weights": np.ones(len(full) - 1, np.float32)},
        )
        scored = engine.forward_backward(model_id, [datum], "cross_entropy", None, False)
        trainer = scored.loss_fn_outputs[0]["logprobs"][-len(result.tokens):]
        np.testing.assert_allclose(result.logprobs, trainer, atol=1e-4, rtol=0)
    unmerged = [name for name in host.resident.values() if name not in host.merged]
    assert unmerged and not any(merged_lora.is_merged(host.base.model, name) for name in unmerged)
