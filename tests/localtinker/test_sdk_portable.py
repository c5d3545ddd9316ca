"""The real tinker SDK against a localtinker whose engine takes the portable path (what a GPU runs), here on the
CPU: training, a sampler over the current weights, sampling and prompt scoring through the HTTP protocol."""

from __future__ import annotations

import numpy as np
import tinker
from tinker import types

from localtinker.engine.engine import LocalEngine
from localtinker.server import start_server
from tests.fixtures.server import LOCAL_API_KEY, TINY_MODEL


def test_sdk_round_trip_on_the_portable_path(tmp_path) -> None:
    engine = LocalEngine(tmp_path / "storage", dtype="float32", portable=True)
    with start_server(tmp_path / "storage", engine=engine) as server:
        client = tinker.ServiceClient(base_url=server.base_url, api_key=LOCAL_API_KEY)
        trainer = client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=1).result()
        tokens = [3, 14, 15, 92, 65, 35, 89, 79]
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        first = trainer.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
        trainer.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        second = trainer.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
        assert second < first
        sampler = trainer.save_weights_and_get_sampling_client("portable").result()
        prompt = types.ModelInput.from_ints(tokens[:4])
        params = types.SamplingParams(max_tokens=5, seed=2, stop=[])
        result = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
        assert [len(s.tokens) for s in result.sequences] == [5, 5]
        full = tokens[:4] + result.sequences[0].tokens
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
        np.testing.assert_allclose(scored[4:], result.sequences[0].logprobs, atol=1e-5)
        client.close("success").result(timeout=60)
