"""bfloat16 mode: bf16 base weights, float32 LoRA/optimizer/head, and sampler-trainer agreement."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localtinker.engine.api import AdamSpec, DatumArrays, LoraSpec, SampleSpec
from localtinker.engine.engine import LocalEngine
from localtinker.engine.models import cpu_has_fast_bf16_matmul
from tests.localtinker.engine.reference import TINY, sft_datum


@pytest.fixture(scope="module")
def bf16_engine(tmp_path_factory):
    return LocalEngine(tmp_path_factory.mktemp("bf16"), dtype="bfloat16")


def test_bf16_storage_with_float32_trainable_state(bf16_engine):
    bf16_engine.create_model("bf16:train:0", TINY, LoraSpec(rank=4, seed=0))
    base = bf16_engine._hosts[TINY].base.model  # noqa: SLF001 - inspecting storage dtypes
    assert base.get_decoder().layers[0].mlp.up_proj.base_layer.weight.dtype == torch.bfloat16
    assert base.get_output_embeddings().base_layer.weight.dtype == torch.float32
    assert all(w.dtype == torch.float32 for w in bf16_engine.lora_weights("bf16:train:0").values())
    rng = np.random.default_rng(0)
    for _ in range(2):
        result = bf16_engine.forward_backward("bf16:train:0", [sft_datum(rng, 12)], "cross_entropy", None, False)
        assert np.isfinite(result.metrics["loss:sum"])
        bf16_engine.optim_step("bf16:train:0", AdamSpec(learning_rate=0.05))


def test_bf16_sampler_agrees_with_trainer(bf16_engine):
    bf16_engine.create_ephemeral_sampler("bf16-sampler", "bf16:train:0")
    spec = SampleSpec(prompt_tokens=tuple(range(40, 52)), num_samples=2, max_tokens=6, seed=5)
    (result,) = bf16_engine.sample_batch([("bf16-sampler", spec)])
    # float32 compute on CPUs without AMX keeps float32-level agreement; bf16 GEMMs would give ~0.05.
    tolerance = 0.2 if cpu_has_fast_bf16_matmul() else 1e-4
    for sequence in result.sequences:
        full = list(spec.prompt_tokens) + sequence.tokens
        datum = DatumArrays(tokens=np.array(full[:-1]), loss_fn_inputs={"target_tokens": np.array(full[1:])})
        learner = bf16_engine.forward_backward("bf16:train:0", [datum], "cross_entropy", None, True)
        np.testing.assert_allclose(learner.loss_fn_outputs[0]["logprobs"][-6:], sequence.logprobs, atol=tolerance)
