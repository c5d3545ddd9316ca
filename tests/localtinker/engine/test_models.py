"""Base-model registry: the tiny test model, local directories, info, and the real SmolLM2 (slow)."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoConfig, AutoTokenizer

from localtinker.engine.api import AdamSpec, DatumArrays, LoraSpec
from localtinker.engine.engine import LocalEngine
from localtinker.engine.models import tiny_random_dir
from localtinker.engine.packaged import SMOLLM2_NAME
from tests.localtinker.engine.reference import TINY, sft_datum


def test_tiny_random_is_small_with_a_real_tokenizer(engine, new_id):
    config = AutoConfig.from_pretrained(tiny_random_dir())
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 2, 49152)
    info = engine.create_model(new_id(), TINY, LoraSpec(rank=2, seed=0))
    tokenizer = AutoTokenizer.from_pretrained(info.tokenizer_id)
    assert tokenizer.decode(tokenizer.encode("Hello world")) == "Hello world"
    assert (info.arch, info.max_context_length) == ("llama", 2048)


def test_local_directory_is_a_base_model(engine, new_id):
    model_id = new_id()
    info = engine.create_model(model_id, str(tiny_random_dir()), LoraSpec(rank=2, seed=0))
    assert info.base_model == str(tiny_random_dir())
    by_name = new_id()
    engine.create_model(by_name, TINY, LoraSpec(rank=2, seed=0))
    datum = [sft_datum(np.random.default_rng(0), 6)]
    lp_dir = engine.forward_backward(model_id, datum, "cross_entropy", None, True).loss_fn_outputs[0]["logprobs"]
    lp_name = engine.forward_backward(by_name, datum, "cross_entropy", None, True).loss_fn_outputs[0]["logprobs"]
    # same deterministic weights, loaded twice (to float32 rounding: oneDNN sums in an order set by alignment)
    np.testing.assert_allclose(lp_dir, lp_name, rtol=1e-6, atol=0)


def test_supported_models_name_loadable_tokenizers(engine):
    names = {info.base_model: info for info in engine.supported_models()}
    assert set(names) == {SMOLLM2_NAME, TINY}
    assert AutoTokenizer.from_pretrained(names[TINY].tokenizer_id).vocab_size > 0


@pytest.mark.slow
def test_sft_on_smollm2_lowers_the_loss(tmp_path, smollm2_tokenizer):
    engine = LocalEngine(tmp_path, dtype="bfloat16")
    engine.create_model("slow:train:0", SMOLLM2_NAME, LoraSpec(rank=8, seed=0))
    text = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid."
    tokens = np.array(smollm2_tokenizer.encode(text))
    datum = DatumArrays(tokens=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:], "weights": np.ones(len(tokens) - 1, np.float32)})
    losses = []
    for _ in range(5):
        losses.append(engine.forward_backward("slow:train:0", [datum], "cross_entropy", None, False).metrics["loss:sum"])
        engine.optim_step("slow:train:0", AdamSpec(learning_rate=1e-3))
    assert losses[-1] < 0.7 * losses[0]
