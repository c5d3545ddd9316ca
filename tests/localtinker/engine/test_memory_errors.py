"""Running out of device memory: a clear error naming the work and what to send instead, and no state changed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localtinker.engine import engine as engine_module
from localtinker.engine import decode_batch, portable_sampling, sample_stream
from localtinker.engine.api import AdamSpec, EngineUserError, LoraSpec, SampleSpec
from localtinker.engine.engine import LocalEngine
from localtinker.engine.memory_errors import DeviceMemoryError, memory_errors_named
from tests.fixtures.faults import out_of_memory_once
from tests.localtinker.engine.reference import TINY, sft_datum


def test_only_out_of_memory_is_translated():
    with pytest.raises(DeviceMemoryError, match=r"^loading x ran out of cpu memory; nothing was changed\. Send less\. "
                                                r"\(torch: CUDA out of memory"):
        with memory_errors_named("loading x", torch.device("cpu"), "Send less."):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
    assert issubclass(DeviceMemoryError, EngineUserError)  # answered as the client's to change, not retried
    with pytest.raises(RuntimeError, match="other"):
        with memory_errors_named("loading x", torch.device("cpu"), "Send less."):
            raise RuntimeError("other")


def test_forward_backward_out_of_memory_names_the_batch_and_keeps_the_gradients(engine, new_id, monkeypatch):
    model_id = new_id()
    engine.create_model(model_id, TINY, LoraSpec(rank=4, seed=1))
    rng = np.random.default_rng(0)
    first, second = [sft_datum(rng, 9)], [sft_datum(rng, 7), sft_datum(rng, 5)]
    engine.forward_backward(model_id, first, "cross_entropy", None, False)
    grads = {key: grad.clone() for key, grad in engine.lora_grads(model_id).items()}
    calls = out_of_memory_once(monkeypatch, engine_module, "token_logprobs_tracking")
    with pytest.raises(DeviceMemoryError) as failed:
        engine.forward_backward(model_id, second, "cross_entropy", None, False)
    message = str(failed.value)
    assert "forward_backward of 2 datums (12 tokens) ran out of cpu memory; nothing was changed" in message
    assert "Send fewer or shorter datums per call" in message and "Tried to allocate 20.00 GiB" in message
    assert calls and all(torch.equal(engine.lora_grads(model_id)[k], g) for k, g in grads.items())
    engine.forward_backward(model_id, second, "cross_entropy", None, False)  # the same call now runs
    engine.optim_step(model_id, AdamSpec(learning_rate=0.01))


@pytest.mark.parametrize("portable", [False, True])
def test_a_decode_step_out_of_memory_fails_its_requests_clearly_and_the_next_ones_run(tmp_path, new_id, monkeypatch,
                                                                                    portable):
    """Where a decode step runs out of memory (inside a weights group of the tuned or the portable stream), each
    of that group's requests gets the user error; the next batch samples as usual."""
    engine = LocalEngine(tmp_path, dtype="float32", portable=portable)
    model_id = new_id()
    engine.create_model(model_id, TINY, LoraSpec(rank=4, seed=1))
    engine.create_ephemeral_sampler("oom-sampler", model_id)
    prompt = SampleSpec(prompt_tokens=(3, 4, 5), max_tokens=3, temperature=0.0, stop_token_ids=())
    batch_class = portable_sampling._Batch if portable else decode_batch.DecodeBatch
    calls = out_of_memory_once(monkeypatch, batch_class, "step")
    failed = engine.sample_batch([("oom-sampler", prompt), ("oom-sampler", prompt)])
    assert calls and all(isinstance(result, DeviceMemoryError) for result in failed)
    assert "sampling 2 requests of one sampler ran out of cpu memory; nothing was changed. Sample fewer" in str(failed[0])
    results = engine.sample_batch([("oom-sampler", prompt), ("oom-sampler", prompt)])
    assert [len(r.sequences[0].tokens) for r in results] == [3, 3]


def test_out_of_memory_outside_a_weights_group_fails_the_step_clearly(engine, new_id, monkeypatch):
    model_id = new_id()
    engine.create_model(model_id, TINY, LoraSpec(rank=4, seed=1))
    engine.create_ephemeral_sampler("oom-sampler", model_id)
    prompt = SampleSpec(prompt_tokens=(3, 4, 5), max_tokens=3, temperature=0.0, stop_token_ids=())
    out_of_memory_once(monkeypatch, sample_stream.SampleStream, "step")
    with pytest.raises(DeviceMemoryError, match=r"sampling 2 requests at once ran out of cpu memory; nothing was "
                                                r"changed\. Sample fewer sequences at once"):
        engine.sample_batch([("oom-sampler", prompt), ("oom-sampler", prompt)])
    results = engine.sample_batch([("oom-sampler", prompt), ("oom-sampler", prompt)])
    assert [len(r.sequences[0].tokens) for r in results] == [3, 3]
