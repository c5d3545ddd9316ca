"""The trainer's frozen linears through packed oneDNN weights: same losses, logprobs and LoRA gradients as
F.linear, forward-only and forward_backward alike, and one packed copy of W shared with the sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import localtinker.engine.packed_training as packed_training
from localtinker.engine.api import LoraSpec
from localtinker.engine.engine import LocalEngine
from localtinker.engine.packed_linear import PACKED_ATTR, pack_frozen_linears, packing_available
from tests.localtinker.engine.reference import TINY, sft_datum

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


def _engine_with_every_linear_packed(tmp_path) -> tuple[LocalEngine, torch.nn.Module]:
    engine = LocalEngine(tmp_path, dtype="float32")
    model = engine._host(TINY).base.model  # noqa: SLF001 - packing the model before the engine measures it
    choices = packed_training.pack_for_training(model, measure=False)
    assert choices and all(choices.values())
    engine.create_model("packed:0", TINY, LoraSpec(rank=4, seed=0))
    return engine, model


def _step(engine, data, monkeypatch, enabled: bool):
    monkeypatch.setattr(packed_training, "ENABLED", enabled)
    result = engine.forward_backward("packed:0", data, "cross_entropy", None, False)
    grads = {key: p.grad.clone() for key, p in engine._models["packed:0"].params.items()}  # noqa: SLF001
    for p in engine._models["packed:0"].params.values():  # noqa: SLF001
        p.grad = None
    return result, grads


def test_packed_training_computes_the_same_losses_and_gradients(tmp_path, monkeypatch):
    engine, model = _engine_with_every_linear_packed(tmp_path)
    rng = np.random.default_rng(0)
    data = [sft_datum(rng, 14, vocab=model.config.vocab_size) for _ in range(3)]
    # Make B non-zero so every LoRA factor gets a gradient through the packed input gradients.
    with torch.no_grad():
        for key, param in engine._models["packed:0"].params.items():  # noqa: SLF001
            if "lora_B" in key:
                param.normal_(0, 0.02)
    packed, packed_grads = _step(engine, data, monkeypatch, enabled=True)
    plain, plain_grads = _step(engine, data, monkeypatch, enabled=False)
    assert packed.metrics["loss:sum"] == pytest.approx(plain.metrics["loss:sum"], rel=1e-5)
    for key, grad in plain_grads.items():
        assert grad.abs().sum() > 0, key
        # Another summation order: float32 rounding differences, small against the gradient's scale.
        torch.testing.assert_close(packed_grads[key], grad, rtol=1e-3, atol=1e-4 * float(grad.abs().max()))


def test_forward_and_forward_backward_logprobs_agree_exactly(tmp_path, monkeypatch):
    engine, model = _engine_with_every_linear_packed(tmp_path)
    data = [sft_datum(np.random.default_rng(1), 12, vocab=model.config.vocab_size)]
    forward = engine.forward_backward("packed:0", data, "cross_entropy", None, True)
    trained = engine.forward_backward("packed:0", data, "cross_entropy", None, False)
    np.testing.assert_array_equal(forward.loss_fn_outputs[0]["logprobs"], trained.loss_fn_outputs[0]["logprobs"])
    monkeypatch.setattr(packed_training, "ENABLED", False)
    plain = engine.forward_backward("packed:0", data, "cross_entropy", None, True)
    np.testing.assert_allclose(forward.loss_fn_outputs[0]["logprobs"], plain.loss_fn_outputs[0]["logprobs"], atol=1e-5)


def test_the_sampler_reuses_the_trainers_packed_weight(tmp_path):
    _, model = _engine_with_every_linear_packed(tmp_path)
    pack_frozen_linears(model, measure=False)
    head = model.get_output_embeddings().base_layer
    assert getattr(head, PACKED_ATTR) is getattr(head, packed_training.TRAIN_PACKED_ATTR)[0]


@pytest.mark.skipif(not packing_available(torch.bfloat16), reason="oneDNN has no bf16 kernels on this CPU")
def test_bf16_weights_pack_where_bf16_computes_natively(tmp_path, monkeypatch):
    from localtinker.engine.bf16_matmul import ENV_CHOICE, bf16_matmul_is_fast

    monkeypatch.setenv(ENV_CHOICE, "bfloat16")
    bf16_matmul_is_fast.cache_clear()
    try:
        engine = LocalEngine(tmp_path, dtype="bfloat16")
        model = engine._host(TINY).base.model  # noqa: SLF001
        assert all(packed_training.pack_for_training(model, measure=False).values())
        engine.create_model("packed:0", TINY, LoraSpec(rank=4, seed=0))
        up_proj = model.get_decoder().layers[0].mlp.up_proj
        assert up_proj.base_layer.weight.dtype == torch.bfloat16
        assert getattr(up_proj.base_layer, "_localtinker_train_packed", None) is not None
        data = [sft_datum(np.random.default_rng(2), 12, vocab=model.config.vocab_size)]
        forward = engine.forward_backward("packed:0", data, "cross_entropy", None, True)
        packed, packed_grads = _step(engine, data, monkeypatch, enabled=True)
        plain, _ = _step(engine, data, monkeypatch, enabled=False)
    finally:
        bf16_matmul_is_fast.cache_clear()
    np.testing.assert_array_equal(forward.loss_fn_outputs[0]["logprobs"], packed.loss_fn_outputs[0]["logprobs"])
    assert packed.metrics["loss:sum"] == pytest.approx(plain.metrics["loss:sum"], rel=1e-2)  # bf16 rounding
    assert all(grad.dtype == torch.float32 and torch.isfinite(grad).all() for grad in packed_grads.values())
