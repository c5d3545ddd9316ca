"""A forward's graph serves the next forward_backward on the same datums: same results, no second forward."""

from __future__ import annotations

import numpy as np
import pytest

import localtinker.engine.engine as engine_module
from localtinker.engine.api import AdamSpec, DatumArrays, LoraSpec
from tests.localtinker.engine.reference import TINY, sft_datum
from tests.localtinker.engine.test_training import grads_equal

PROMPT = 20  # prompt tokens of each datum (shared by a pair: >= 16): weight 0 in the forward, like a DPO side's prompt


def _pair_datums(seed: int) -> list[DatumArrays]:
    """Two datums sharing a prompt (a DPO pair's chosen and rejected), weights 1 on the completion."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 49152, PROMPT)
    datums = []
    for _ in range(2):
        tokens = np.concatenate([prompt, rng.integers(0, 49152, 9)])
        weights = (np.arange(len(tokens) - 1) >= PROMPT - 1).astype(np.float32)
        datums.append(DatumArrays(tokens=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights}))
    return datums


def _with_weights(datums: list[DatumArrays], weights: list[np.ndarray]) -> list[DatumArrays]:
    return [DatumArrays(tokens=d.tokens, loss_fn_inputs={**d.loss_fn_inputs, "weights": w}) for d, w in zip(datums, weights)]


def _custom_step(engine, model_id: str, datums: list[DatumArrays], gradient_weights) -> tuple:
    """What the SDK's forward_backward_custom sends: a forward, then forward_backward with new weights."""
    forward = engine.forward_backward(model_id, datums, "cross_entropy", None, True)
    second = engine.forward_backward(model_id, _with_weights(datums, gradient_weights(forward)), "cross_entropy", None, False)
    grads = engine.lora_grads(model_id)
    engine.optim_step(model_id, AdamSpec(learning_rate=0.0))  # clears the gradients
    return forward, second, grads


@pytest.fixture
def trained(engine, new_id):
    """A model whose lora_B is non-zero, and a counter of the decoder's forward passes."""
    model_id = new_id()
    engine.create_model(model_id, TINY, LoraSpec(rank=4, seed=7))
    engine.forward_backward(model_id, [sft_datum(np.random.default_rng(3), 10)], "cross_entropy", None, False)
    engine.optim_step(model_id, AdamSpec(learning_rate=0.05))
    decoder = engine._hosts[TINY].base.model.get_decoder()
    calls = []
    handle = decoder.register_forward_hook(lambda *args: calls.append(1))
    yield model_id, calls
    handle.remove()


def _dpo_like(forward) -> list[np.ndarray]:
    """-dC/dlogprobs of a loss over the completion tokens (nonzero where the forward's weights are)."""
    out = []
    for index, output in enumerate(forward.loss_fn_outputs):
        weights = (np.arange(len(output["logprobs"])) >= PROMPT - 1).astype(np.float32)
        out.append(weights * (0.5 if index % 2 == 0 else -0.5) * np.exp(output["logprobs"].clip(-5, 0)))
    return out


def test_the_backward_reuses_the_forward_and_matches_recomputing_it(engine, trained, monkeypatch):
    model_id, calls = trained
    datums = _pair_datums(0)
    forward, second, grads = _custom_step(engine, model_id, datums, _dpo_like)
    reused_calls = len(calls)
    monkeypatch.setattr(engine_module, "RETAIN_FORWARDS", False)
    calls.clear()
    forward_again, second_again, grads_again = _custom_step(engine, model_id, datums, _dpo_like)
    assert reused_calls < len(calls)  # the kept graph spared the second call its forward
    for a, b in zip(forward.loss_fn_outputs + second.loss_fn_outputs,
                    forward_again.loss_fn_outputs + second_again.loss_fn_outputs):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(a["elementwise_loss"], b["elementwise_loss"], rtol=0, atol=1e-6)
    assert second.metrics["loss:sum"] == pytest.approx(second_again.metrics["loss:sum"], rel=1e-6)
    assert any(float(g.abs().max()) > 0 for g in grads.values())
    grads_equal(grads, grads_again)


def _prompt_weighted(forward) -> list[np.ndarray]:
    """A loss that also moves prompt tokens the forward left untracked (weight 0 there)."""
    return [np.full(len(o["logprobs"]), 0.3, np.float32) for o in forward.loss_fn_outputs]


@pytest.mark.parametrize("change", ["other tokens", "weights changed", "untracked tokens"])
def test_anything_else_runs_the_forward_again_with_the_same_results(engine, trained, monkeypatch, change):
    model_id, calls = trained
    datums, gradient_weights = _pair_datums(1), _dpo_like
    if change == "untracked tokens":
        gradient_weights = _prompt_weighted
    forward = engine.forward_backward(model_id, datums, "cross_entropy", None, True)
    if change == "other tokens":
        datums = _pair_datums(2)  # same lengths, other tokens
    if change == "weights changed":
        engine.optim_step(model_id, AdamSpec(learning_rate=0.0))  # a weight update (here a no-op one)
    backward_datums = _with_weights(datums, gradient_weights(forward))
    calls.clear()
    second = engine.forward_backward(model_id, backward_datums, "cross_entropy", None, False)
    assert calls  # the forward ran again
    grads = engine.lora_grads(model_id)
    engine.optim_step(model_id, AdamSpec(learning_rate=0.0))
    monkeypatch.setattr(engine_module, "RETAIN_FORWARDS", False)
    expected = engine.forward_backward(model_id, backward_datums, "cross_entropy", None, False)
    grads_equal(grads, engine.lora_grads(model_id))
    engine.optim_step(model_id, AdamSpec(learning_rate=0.0))
    assert second.metrics["loss:sum"] == pytest.approx(expected.metrics["loss:sum"], rel=1e-6)


def test_past_the_token_budget_micro_batches_run_again_in_the_backward_call(engine, trained, monkeypatch):
    model_id, calls = trained
    # one pair (20 + 2 × 9 tokens) per micro-batch: pairs share a prompt, so they get 2 × 20 tokens
    monkeypatch.setattr(engine_module, "TRAIN_MICROBATCH_TOKENS", 20)
    monkeypatch.setattr(engine_module, "SHARED_MICROBATCH_FACTOR", 2)
    monkeypatch.setattr(engine_module, "RETAINED_FORWARD_TOKENS", 20)  # the first micro-batch is kept, no more
    datums = [datum for seed in (5, 6, 7) for datum in _pair_datums(seed)]
    forward, second, grads = _custom_step(engine, model_id, datums, _dpo_like)
    partly_kept = len(calls)
    monkeypatch.setattr(engine_module, "RETAIN_FORWARDS", False)
    calls.clear()
    forward_again, second_again, grads_again = _custom_step(engine, model_id, datums, _dpo_like)
    # Recomputing runs 2 decoder passes (prefix, members) per pair in each call: 12. Kept: 2 fewer.
    assert (partly_kept, len(calls)) == (10, 12)
    for a, b in zip(second.loss_fn_outputs, second_again.loss_fn_outputs):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=0, atol=1e-6)
    assert second.metrics["loss:sum"] == pytest.approx(second_again.metrics["loss:sum"], rel=1e-6)
    grads_equal(grads, grads_again)


def test_a_kept_forward_is_dropped_when_its_model_goes_or_another_forward_is_kept(engine, trained, new_id):
    model_id, _ = trained
    engine.forward_backward(model_id, _pair_datums(4), "cross_entropy", None, True)
    assert engine._retained is not None and engine._retained.model_id == model_id
    other = new_id()
    engine.create_model(other, TINY, LoraSpec(rank=4, seed=1))
    engine.forward_backward(other, _pair_datums(4), "cross_entropy", None, True)
    assert engine._retained.model_id == other  # one per engine: memory stays bounded
    engine.unload_model(other)
    assert engine._retained is None
