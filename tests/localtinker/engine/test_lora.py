"""The fused LoRA forward computes exactly peft's function, values and gradients, and steps aside otherwise."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import localtinker.engine.lora as lora
from localtinker.engine.api import LoraSpec
from localtinker.engine.models import tiny_random_dir
from tests.localtinker.engine.reference import host_with_random_b


def _loss_and_grads(
    host: lora.AdapterHost, name: str, tokens: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    params = host.parameters(name)
    for param in params.values():
        param.grad = None
    with host.activated(name):
        logits = host.model(input_ids=tokens).logits
    loss = logits.log_softmax(-1).gather(-1, tokens[..., None]).sum()
    loss.backward()
    return logits.detach(), {key: p.grad.clone() for key, p in params.items()}


def test_fused_forward_matches_peft_in_values_and_gradients(monkeypatch):
    host, name = host_with_random_b()
    tokens = torch.randint(0, 200, (2, 11), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(lora, "FUSED_FORWARD", True)
    fused_logits, fused_grads = _loss_and_grads(host, name, tokens)
    monkeypatch.setattr(lora, "FUSED_FORWARD", False)
    peft_logits, peft_grads = _loss_and_grads(host, name, tokens)

    torch.testing.assert_close(fused_logits, peft_logits, rtol=1e-5, atol=1e-5)
    assert fused_grads.keys() == peft_grads.keys() and any("lm_head" in key for key in fused_grads)
    for key in fused_grads:
        # Same function, another float32 summation order: agreement to rounding at the gradient's scale.
        scale = float(peft_grads[key].abs().max())
        torch.testing.assert_close(fused_grads[key], peft_grads[key], rtol=1e-4, atol=1e-5 * scale, msg=key)


def test_every_lora_layer_is_routed_through_the_fused_forward_once():
    host, _ = host_with_random_b()
    from peft.tuners.lora import Linear as LoraLinear

    layers = [m for m in host.model.modules() if isinstance(m, LoraLinear)]
    assert layers and all(getattr(m, "_localtinker_fused", False) for m in layers)
    forwards = [m.forward for m in layers]
    lora.install_fused_forward(host.model)  # a second adapter re-runs the install: must not wrap twice
    assert [m.forward for m in layers] == forwards


@pytest.mark.parametrize("case", ["adapters_disabled", "no_adapter_active"])
def test_fused_forward_falls_back_to_the_plain_model(case):
    host, name = host_with_random_b()
    tokens = torch.randint(0, 200, (1, 7), generator=torch.Generator().manual_seed(4))
    plain = AutoModelForCausalLM.from_pretrained(tiny_random_dir(), dtype=torch.float32)
    with torch.no_grad():
        expected = plain(input_ids=tokens).logits
        if case == "adapters_disabled":
            with host.activated(None):
                got = host.model(input_ids=tokens).logits
        else:
            with host.activated(name):
                with_adapter = host.model(input_ids=tokens).logits
            with host.activated(None):
                got = host.model(input_ids=tokens).logits
            assert not torch.allclose(with_adapter, expected, atol=1e-4)  # the random B really changes outputs
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_fused_forward_under_bf16_autocast_matches_peft_and_runs_each_base_layer_once(monkeypatch):
    from peft.tuners.lora import Linear as LoraLinear

    host, name = host_with_random_b()
    tokens = torch.randint(0, 200, (1, 9), generator=torch.Generator().manual_seed(5))
    base_calls: list[int] = []
    lora_layers = [m for m in host.model.modules() if isinstance(m, LoraLinear)]
    for layer in lora_layers:
        layer.base_layer.register_forward_hook(lambda *_: base_calls.append(1))
    logits = {}
    for fused in (True, False):
        monkeypatch.setattr(lora, "FUSED_FORWARD", fused)
        base_calls.clear()
        with torch.no_grad(), host.activated(name), torch.autocast("cpu", dtype=torch.bfloat16):
            logits[fused] = host.model(input_ids=tokens).logits.float()
        # Under autocast the base output is bf16 and the LoRA weights float32: the mixed-dtype branch
        # must reuse that output, not fall back to peft's forward (which would run the base again).
        assert len(base_calls) == len(lora_layers)
    torch.testing.assert_close(logits[True], logits[False], rtol=0, atol=0.05)


def test_bf16_factors_are_cast_once_without_autograd_and_recast_after_an_update():
    model = AutoModelForCausalLM.from_pretrained(tiny_random_dir(), dtype=torch.bfloat16).eval()
    model.requires_grad_(False)
    host = lora.AdapterHost(model)
    name = host.add_adapter(LoraSpec(rank=4, train_attn=True, train_mlp=True, train_unembed=False), seed=0)
    params = host.parameters(name)
    with torch.no_grad():
        for key, param in params.items():
            if "lora_B" in key:
                param.normal_(0, 0.05)
    tokens = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(4))

    def logits(grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(grad), host.activated(name):
            return host.model(input_ids=tokens).logits.detach().float()

    cached = logits(grad=False)
    layer = model.get_decoder().layers[0].mlp.up_proj
    assert layer.__dict__[lora._CAST]  # the no-grad pass kept its rounded factors
    first_factors = layer.__dict__[lora._CAST][name][1]
    assert torch.equal(logits(grad=False), cached) and layer.__dict__[lora._CAST][name][1] is first_factors
    assert torch.equal(logits(grad=True), cached)  # the same function as the cast-every-call path
    with torch.no_grad():
        for key, param in params.items():
            if "lora_B" in key:
                param.add_(0.05)  # in place, as the optimizer updates
    updated = logits(grad=False)
    assert not torch.allclose(updated, cached)
    assert torch.equal(updated, logits(grad=True))
    host.delete_adapter(name)
    assert name not in layer.__dict__[lora._CAST]  # a deleted adapter's rounded factors go with it


def test_deleting_the_adapter_peft_has_active_is_silent_and_leaves_the_others_working():
    """peft warns when the adapter it deletes was its active one (an evicted sampler's, a released session's):
    which adapter runs is the host's to say, so nothing is printed; the remaining adapter computes as before."""
    model = AutoModelForCausalLM.from_pretrained(tiny_random_dir(), dtype=torch.float32).eval()
    model.requires_grad_(False)
    host = lora.AdapterHost(model)
    spec = LoraSpec(rank=4, train_attn=True, train_mlp=True, train_unembed=False)
    kept, dropped = host.add_adapter(spec, seed=0), host.add_adapter(spec, seed=1)
    tokens = torch.randint(0, 200, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), host.activated(kept):
        before = host.model(input_ids=tokens).logits
    with torch.no_grad(), host.activated(dropped):
        host.model(input_ids=tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        host.delete_adapter(dropped)
    with torch.no_grad(), host.activated(kept):
        assert torch.equal(host.model(input_ids=tokens).logits, before)


@pytest.mark.parametrize("merged_slots", [1, 2], ids=["fewer-merge-slots", "every-resident-adapter-merged"])
def test_a_full_resident_set_reuses_an_adapter_for_the_next_snapshot(engine, new_id, monkeypatch, merged_slots):
    """An RL loop samples a new snapshot every step: once RESIDENT_SAMPLER_ADAPTERS are resident, the next
    snapshot's weights go into the least recently used adapter of the same layout instead of a newly injected
    one, and every sampler still scores exactly like the trainer at its own step (no stale merged copy or
    weights; with as many merge slots as resident adapters, the reused one is merged when it is taken). A
    sampler of another rank gets a new adapter."""
    import numpy as np

    import localtinker.engine.engine as engine_module
    from localtinker.engine.api import AdamSpec, DatumArrays, SampleSpec
    from tests.localtinker.engine.reference import TINY, sft_datum

    monkeypatch.setattr(engine_module, "MERGED_SAMPLER_ADAPTERS", merged_slots)
    host = engine._hosts.get(TINY) or engine._host(TINY)  # noqa: SLF001 - counting injections
    injected: list[int] = []
    add_adapter = host.adapters.add_adapter
    monkeypatch.setattr(host.adapters, "add_adapter", lambda spec, seed: injected.append(spec.rank) or add_adapter(spec, seed))
    with warnings.catch_warnings():  # peft says which adapter it activates instead of a deleted one
        warnings.simplefilter("ignore")
        for name in list(host.resident.values()):  # start from an empty resident set: other tests share the engine
            host.adapters.delete_adapter(name)
    host.resident.clear()
    host.merged.clear()

    model_id = new_id()
    engine.create_model(model_id, TINY, LoraSpec(rank=4, seed=3))
    injected.clear()
    rng = np.random.default_rng(0)
    prompt = tuple(range(300, 310))
    snapshots = engine_module.RESIDENT_SAMPLER_ADAPTERS + 3
    for step in range(snapshots):
        engine.forward_backward(model_id, [sft_datum(rng, 12)], "cross_entropy", None, False)
        engine.optim_step(model_id, AdamSpec(learning_rate=0.05))
        engine.create_ephemeral_sampler(f"reuse-{step}", model_id)
        spec = SampleSpec(prompt_tokens=prompt, max_tokens=5, seed=step, stop_token_ids=())
        sampled = engine.sample_batch([(f"reuse-{step}", spec)])[0].sequences[0]
        full = list(prompt) + sampled.tokens
        datum = DatumArrays(
            tokens=np.array(full[:-1]),
            loss_fn_inputs={"target_tokens": np.array(full[1:]), "weights": np.ones(len(full) - 1, np.float32)},
        )
        trainer = engine.forward_backward(model_id, [datum], "cross_entropy", None, True).loss_fn_outputs[0]["logprobs"]
        np.testing.assert_allclose(sampled.logprobs, trainer[-len(sampled.tokens):], atol=1e-4, rtol=0)
        assert len(host.resident) <= engine_module.RESIDENT_SAMPLER_ADAPTERS
    assert injected == [4] * engine_module.RESIDENT_SAMPLER_ADAPTERS  # the other snapshots reused adapters

    other = new_id()
    engine.create_model(other, TINY, LoraSpec(rank=8, seed=3))
    engine.create_ephemeral_sampler("reuse-rank-8", other)
    engine.sample_batch([("reuse-rank-8", SampleSpec(prompt_tokens=prompt, max_tokens=2, seed=0, stop_token_ids=()))])
    assert injected[-1] == 8  # a different layout is injected, never squeezed into a rank-4 adapter
