"""bfloat16 mode: bf16 base weights, float32 LoRA/optimizer/head master, and sampler-trainer agreement.

Every case runs twice: matmuls in float32 (CPUs where bf16 is not faster) and in bf16 (where it is),
whichever this machine would pick, so both paths are tested on every machine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localtinker.engine.api import AdamSpec, DatumArrays, LoraSpec, SampleSpec
from localtinker.engine.engine import LocalEngine
from localtinker.engine.bf16_head import Bf16Head
from localtinker.engine.bf16_matmul import ENV_CHOICE, bf16_matmul_is_fast
from localtinker.engine.attention import NAME as ENGINE_ATTENTION
from tests.localtinker.engine.reference import TINY, sft_datum


@pytest.fixture(scope="module", params=["float32", "bfloat16"], ids=["float32-matmuls", "bf16-matmuls"])
def bf16_engine(request, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV_CHOICE, request.param)
        bf16_matmul_is_fast.cache_clear()
        engine = LocalEngine(tmp_path_factory.mktemp("bf16"), dtype="bfloat16")
        engine.create_model("bf16:train:0", TINY, LoraSpec(rank=4, seed=0))  # loads the base under the choice
        yield engine
    bf16_matmul_is_fast.cache_clear()


def test_bf16_storage_with_float32_trainable_state(bf16_engine):
    base = bf16_engine._hosts[TINY].base.model  # noqa: SLF001 - inspecting storage dtypes
    up_proj = base.get_decoder().layers[0].mlp.up_proj.base_layer
    assert up_proj.weight.dtype == torch.bfloat16
    hidden = torch.randn(2, up_proj.in_features, dtype=torch.bfloat16)
    # bf16 matmuls keep activations in bf16 (attention.py: bf16 products, float32 softmax); float32
    # matmuls keep the whole body in float32. Either way the attention is the engine's (shared prompts).
    native = bf16_matmul_is_fast()
    assert up_proj(hidden).dtype == (torch.bfloat16 if native else torch.float32)
    assert base.config._attn_implementation == ENGINE_ATTENTION
    head = base.get_output_embeddings().base_layer
    assert head.weight.dtype == torch.float32  # the master copy; bf16 compute adds bf16 copies (bf16_head.py)
    assert isinstance(head, Bf16Head) == native
    assert all(w.dtype == torch.float32 for w in bf16_engine.lora_weights("bf16:train:0").values())
    rng = np.random.default_rng(0)
    for _ in range(2):
        result = bf16_engine.forward_backward("bf16:train:0", [sft_datum(rng, 12)], "cross_entropy", None, False)
        assert np.isfinite(result.metrics["loss:sum"])
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in bf16_engine._models["bf16:train:0"].params.values())  # noqa: SLF001
        bf16_engine.optim_step("bf16:train:0", AdamSpec(learning_rate=0.05))


def test_bf16_sampler_agrees_with_trainer(bf16_engine):
    bf16_engine.create_ephemeral_sampler("bf16-sampler", "bf16:train:0")
    spec = SampleSpec(prompt_tokens=tuple(range(40, 52)), num_samples=2, max_tokens=6, seed=5)
    (result,) = bf16_engine.sample_batch([("bf16-sampler", spec)])
    # float32 compute (where bf16 matmuls are not faster) keeps float32-level agreement; bf16 GEMMs ~0.05.
    tolerance = 0.2 if bf16_matmul_is_fast() else 1e-4
    for sequence in result.sequences:
        full = list(spec.prompt_tokens) + sequence.tokens
        datum = DatumArrays(tokens=np.array(full[:-1]), loss_fn_inputs={"target_tokens": np.array(full[1:])})
        learner = bf16_engine.forward_backward("bf16:train:0", [datum], "cross_entropy", None, True)
        np.testing.assert_allclose(learner.loss_fn_outputs[0]["logprobs"][-6:], sequence.logprobs, atol=tolerance)


def test_bf16_turns_that_reuse_kept_keys_agree_with_the_trainer_as_closely(bf16_engine):
    """Keys and values kept from an earlier turn (prefix_store.py) are the ones a prefill would compute."""
    bf16_engine.create_ephemeral_sampler("bf16-conversation", "bf16:train:0")
    stream = bf16_engine.sample_stream()
    tolerance = 0.2 if bf16_matmul_is_fast() else 1e-4
    prompt = tuple(range(100, 136))
    for turn in range(3):
        spec = SampleSpec(prompt_tokens=prompt, max_tokens=6, seed=turn, stop_token_ids=())
        stream.submit(turn, "bf16-conversation", spec)
        results = {}
        while stream.busy:
            results.update(stream.step())
        sequence = results[turn].sequences[0]
        full = list(prompt) + sequence.tokens
        datum = DatumArrays(tokens=np.array(full[:-1]), loss_fn_inputs={"target_tokens": np.array(full[1:])})
        learner = bf16_engine.forward_backward("bf16:train:0", [datum], "cross_entropy", None, True)
        np.testing.assert_allclose(learner.loss_fn_outputs[0]["logprobs"][-6:], sequence.logprobs, atol=tolerance)
        prompt = prompt + tuple(sequence.tokens) + (7, 8, 9)
    assert stream.stats.reused_prefix_tokens == 36 + (36 + 6 + 3 + 5)


def test_bf16_samples_sharing_a_prompt_train_with_the_logprobs_each_gets_alone(bf16_engine, monkeypatch):
    """A group's samples attend to their shared prompt through shared_prefix_attention.py, alone through
    the dense attention (attention.py): both multiply in the model's compute dtype, so they agree to it."""
    import localtinker.engine.attention as attention

    calls = []
    shared = attention.shared_prefix_attention
    monkeypatch.setattr(attention, "shared_prefix_attention", lambda *args: calls.append(1) or shared(*args))
    rng = np.random.default_rng(3)
    data = []
    for prompt in (rng.integers(0, 200, size=20), rng.integers(0, 200, size=27)):
        for _ in range(3):
            tokens = np.concatenate([prompt, rng.integers(0, 200, size=int(rng.integers(3, 9)))])
            data.append(DatumArrays(tokens=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:]}))
    together = bf16_engine.forward_backward("bf16:train:0", data, "cross_entropy", None, True)
    assert calls  # the group path ran
    tolerance = 0.03 if bf16_matmul_is_fast() else 1e-4  # measured: up to ~0.012 with bf16 products
    for datum, output in zip(data, together.loss_fn_outputs):
        alone = bf16_engine.forward_backward("bf16:train:0", [datum], "cross_entropy", None, True)
        np.testing.assert_allclose(output["logprobs"], alone.loss_fn_outputs[0]["logprobs"], atol=tolerance)
