"""Models brought from the hub through the real tinker SDK and server: a family that scales its logits (Granite)
trains and samples as its own forward on the files the user has, and models localtinker cannot compute as their
own forward are refused at ``create_lora_training_client`` with the reason (output_head.py, families.py)."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from transformers import AutoModelForCausalLM, Qwen3NextConfig

from localtinker.engine.engine import LocalEngine
from localtinker.server import start_server
from tests.fixtures.server import LOCAL_API_KEY
from tests.localtinker.engine.families import family_dir

TOKENS = [3, 14, 15, 92, 65, 35, 89, 79, 323, 846]


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def test_a_granite_model_trains_and_samples_as_its_own_forward_through_the_sdk(tmp_path) -> None:
    granite = str(family_dir("granite"))  # logits divided by 4, µP multipliers inside
    own = AutoModelForCausalLM.from_pretrained(granite, dtype=torch.float32)  # the files, as the user has them
    with torch.no_grad():
        logits = own(input_ids=torch.tensor([TOKENS[:-1]])).logits[0]
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(TOKENS[1:])[:, None]).squeeze(-1).numpy()
    with start_server(tmp_path / "storage", engine=LocalEngine(tmp_path / "storage", dtype="float32")) as server:
        client = tinker.ServiceClient(base_url=server.base_url, api_key=LOCAL_API_KEY)
        trainer = client.create_lora_training_client(base_model=granite, rank=4, seed=1).result()
        assert trainer.get_info().model_data.arch == "granite"
        first = trainer.forward_backward([_datum(TOKENS)], "cross_entropy").result()
        np.testing.assert_allclose(first.loss_fn_outputs[0]["logprobs"].tolist(), expected, atol=1e-5)  # B = 0
        trainer.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        second = trainer.forward_backward([_datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"]
        assert second < first.metrics["loss:sum"]
        sampler = trainer.save_weights_and_get_sampling_client("granite").result()
        result = sampler.sample(types.ModelInput.from_ints(TOKENS[:4]), num_samples=1,
                                sampling_params=types.SamplingParams(max_tokens=5, seed=2, stop=[])).result()
        full = TOKENS[:4] + result.sequences[0].tokens
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
        np.testing.assert_allclose(scored[4:], result.sequences[0].logprobs, atol=1e-5)
        client.close("success").result(timeout=60)


def test_a_model_with_recurrent_layers_is_refused_at_create_with_the_reason(tmp_path) -> None:
    Qwen3NextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2).save_pretrained(tmp_path / "qwen3-next")  # no weights: never read
    with start_server(tmp_path / "storage", engine=LocalEngine(tmp_path / "storage", dtype="float32")) as server:
        client = tinker.ServiceClient(base_url=server.base_url, api_key=LOCAL_API_KEY)
        with pytest.raises(Exception, match=r"qwen3_next\) has layers of type linear_attention.*nothing was loaded"):
            client.create_lora_training_client(base_model=str(tmp_path / "qwen3-next"), rank=4).result()
        trainer = client.create_lora_training_client(base_model=str(family_dir("llama")), rank=4).result()
        assert trainer.get_info().model_data.arch == "llama"  # the server goes on serving
        client.close("success").result(timeout=60)
