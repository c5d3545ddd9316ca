"""Each built-in loss: value, per-datum logprobs and gradients against an independent torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localtinker.engine.api import AdamSpec, DatumArrays, EngineUserError, LoraSpec
from tests.localtinker.engine.reference import TINY, ReferenceModel, sft_datum

LENGTHS = (9, 14)


@pytest.fixture(scope="module")
def trained(engine):
    """A model whose LoRA B is non-zero (one large step), so every adapter tensor gets gradient."""
    model_id = "losses:train:0"
    engine.create_model(model_id, TINY, LoraSpec(rank=4, seed=3))
    rng = np.random.default_rng(0)
    engine.forward_backward(model_id, [sft_datum(rng, 12)], "cross_entropy", None, False)
    engine.optim_step(model_id, AdamSpec(learning_rate=0.05))
    return model_id


def rl_data(reference: ReferenceModel, seed: int) -> list[DatumArrays]:
    """Sampler logprobs = current logprobs + offsets so that ratios land on both sides of every clip bound."""
    rng = np.random.default_rng(seed)
    data = []
    for length in LENGTHS:
        tokens = rng.integers(0, 49152, size=length + 1)
        with torch.no_grad():
            current = reference.logprobs(tokens[:-1], tokens[1:]).numpy()
        offsets = rng.choice([-1.0, -0.4, -0.05, 0.05, 0.4, 1.0], size=length)
        advantages = rng.choice([-1.5, -0.5, 0.5, 2.0], size=length)
        advantages[0] = 0.0  # an observation token
        inputs = {
            "target_tokens": tokens[1:],
            "logprobs": (current + offsets).astype(np.float32),
            "advantages": advantages.astype(np.float32),
            "mask": np.ones(length, np.float32),  # unknown keys are ignored
            "sequence_ratio_mask": (advantages != 0).astype(np.float32),  # read by gspo only
        }
        data.append(DatumArrays(tokens=tokens[:-1], loss_fn_inputs=inputs))
    return data


def reference_loss(name: str, lp: torch.Tensor, inputs: dict[str, np.ndarray], config: dict[str, float]) -> torch.Tensor:
    q = torch.as_tensor(inputs["logprobs"])
    adv = torch.as_tensor(inputs["advantages"])
    ratio = (lp - q).exp()
    if name == "importance_sampling":
        return -(ratio * adv).sum()
    if name == "ppo":
        low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
        return -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv).sum()
    if name == "cispo":
        low, high = config.get("clip_low_threshold", 0.0), config.get("clip_high_threshold", 4.0)
        return -(torch.clamp(ratio, low, high).detach() * lp * adv).sum()
    if name == "dro":
        return -(lp * adv - 0.5 * config["beta"] * (lp - q) ** 2).sum()
    if name == "gspo":
        low, high = config.get("clip_low_threshold", 1 - 3e-4), config.get("clip_high_threshold", 1 + 4e-4)
        mask = torch.as_tensor(inputs["sequence_ratio_mask"])
        sequence_ratio = (((lp.detach() - q) * mask).sum() / mask.sum()).exp()
        token_ratio = sequence_ratio * (lp - lp.detach()).exp()
        return -torch.minimum(token_ratio * adv, torch.clamp(token_ratio, low, high) * adv).sum()
    raise AssertionError(name)


def assert_grad_close(actual: torch.Tensor, expected: torch.Tensor, key: str) -> None:
    """Norm-relative closeness. The tiny random model's softmax is near-uniform, so lm_head gradients are
    sums of heavily cancelling terms and *both* float32 paths sit ~1e-3 from a float64 reference; a wrong
    formula is off by O(1)."""
    error = float(torch.linalg.vector_norm(actual - expected))
    assert error <= 5e-3 * float(torch.linalg.vector_norm(expected)) + 1e-7, f"{key}: error norm {error}"


def run_both(engine, model_id: str, name: str, config: dict[str, float] | None, data, ref_loss):
    reference = ReferenceModel(engine.lora_spec(model_id), engine.lora_weights(model_id))
    result = engine.forward_backward(model_id, data, name, config, forward_only=False)
    grads = engine.lora_grads(model_id)
    engine.optim_step(model_id, AdamSpec(learning_rate=0.0))  # clears the grads, weights unchanged
    total = torch.zeros(())
    for datum, output in zip(data, result.loss_fn_outputs):
        lp = reference.logprobs(datum.tokens, datum.loss_fn_inputs["target_tokens"])
        np.testing.assert_allclose(output["logprobs"], lp.detach().numpy(), atol=1e-5)
        datum_loss = ref_loss(lp, datum.loss_fn_inputs)
        assert output["elementwise_loss"].shape == lp.shape  # each datum's own tokens, in order
        assert float(output["elementwise_loss"].sum()) == pytest.approx(datum_loss.item(), rel=1e-5, abs=1e-5)
        total = total + datum_loss
    total.backward()
    assert result.metrics["loss:sum"] == pytest.approx(total.item(), rel=1e-5, abs=1e-3)
    for key, grad in reference.grads().items():
        assert_grad_close(grads[key], grad, key)
    return result, grads


def test_cross_entropy_is_weighted_token_sum(engine, trained):
    rng = np.random.default_rng(1)
    data = [sft_datum(rng, n) for n in LENGTHS]

    def ref(lp, inputs):
        return -(torch.as_tensor(inputs["weights"]) * lp).sum()

    result, _ = run_both(engine, trained, "cross_entropy", None, data, ref)
    per_datum = [-(o["logprobs"] * d.loss_fn_inputs["weights"]).sum() for o, d in zip(result.loss_fn_outputs, data)]
    assert result.metrics["loss:sum"] == pytest.approx(sum(per_datum), rel=1e-5)  # summed, not averaged


@pytest.mark.parametrize(
    "name,config",
    [
        ("importance_sampling", None),
        ("ppo", None),
        ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
        ("cispo", None),
        ("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
        ("dro", {"beta": 0.7}),
        ("gspo", None),
        ("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}),
    ],
)
def test_rl_loss_value_and_gradient(engine, trained, name, config):
    reference = ReferenceModel(engine.lora_spec(trained), engine.lora_weights(trained))
    data = rl_data(reference, seed=7)
    run_both(engine, trained, name, config, data, lambda lp, inputs: reference_loss(name, lp, inputs, config or {}))


def test_ppo_data_exercise_both_clipped_regions(engine, trained):
    reference = ReferenceModel(engine.lora_spec(trained), engine.lora_weights(trained))
    ratios = []
    for datum in rl_data(reference, seed=7):
        with torch.no_grad():
            lp = reference.logprobs(datum.tokens, datum.loss_fn_inputs["target_tokens"])
        ratios.append((lp - torch.as_tensor(datum.loss_fn_inputs["logprobs"])).exp())
    ratio = torch.cat(ratios)
    assert (ratio < 0.8).any() and (ratio > 1.2).any() and ((ratio > 0.8) & (ratio < 1.2)).any()


def test_ppo_clipped_tokens_get_no_gradient(engine, trained):
    """With every ratio above 1.2 and positive advantages, PPO's objective is flat: zero gradient."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 49152, size=11)
    lp = engine.forward_backward(
        trained,
        [DatumArrays(tokens=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:]})],
        "cross_entropy",
        None,
        forward_only=True,
    ).loss_fn_outputs[0]["logprobs"]
    inputs = {"target_tokens": tokens[1:], "logprobs": lp - 1.0, "advantages": np.ones(10, np.float32)}
    result = engine.forward_backward(trained, [DatumArrays(tokens[:-1], inputs)], "ppo", None, False)
    grads = engine.lora_grads(trained)
    engine.optim_step(trained, AdamSpec(learning_rate=0.0))
    assert result.metrics["loss:sum"] == pytest.approx(-1.2 * 10, rel=1e-5)
    assert all(float(g.abs().max()) == 0.0 for g in grads.values())


def test_cispo_stop_gradient_matters(engine, trained):
    """CISPO's gradient is clip(r)·A·∇lp; without the stop-gradient it would be different."""
    reference = ReferenceModel(engine.lora_spec(trained), engine.lora_weights(trained))
    data = rl_data(reference, seed=11)
    _, grads = run_both(
        engine, trained, "cispo", None, data, lambda lp, inputs: reference_loss("cispo", lp, inputs, {})
    )
    for datum in data:
        q = torch.as_tensor(datum.loss_fn_inputs["logprobs"])
        adv = torch.as_tensor(datum.loss_fn_inputs["advantages"])
        lp = reference.logprobs(datum.tokens, datum.loss_fn_inputs["target_tokens"])
        (-(torch.clamp((lp - q).exp(), 0.0, 4.0) * lp * adv).sum()).backward()
    no_stop_gradient = reference.grads()
    assert any(not torch.allclose(grads[k], no_stop_gradient[k], rtol=1e-3) for k in grads)


def test_dro_quadratic_term_changes_value(engine, trained):
    reference = ReferenceModel(engine.lora_spec(trained), engine.lora_weights(trained))
    data = rl_data(reference, seed=5)
    with_beta = engine.forward_backward(trained, data, "dro", {"beta": 2.0}, forward_only=True).metrics["loss:sum"]
    without = engine.forward_backward(trained, data, "dro", {"beta": 0.0}, forward_only=True).metrics["loss:sum"]
    deviations = sum(
        float(((out["logprobs"] - d.loss_fn_inputs["logprobs"]) ** 2).sum())
        for out, d in zip(engine.forward_backward(trained, data, "dro", {"beta": 0.0}, True).loss_fn_outputs, data)
    )
    assert with_beta - without == pytest.approx(0.5 * 2.0 * deviations, rel=1e-4)


@pytest.mark.parametrize("name", ["stable_reinforce", "mse", ""])
def test_unsupported_loss_names_the_supported_ones(engine, trained, name):
    rng = np.random.default_rng(0)
    with pytest.raises(EngineUserError, match="cross_entropy, importance_sampling, ppo, cispo, dro, gspo"):
        engine.forward_backward(trained, [sft_datum(rng, 5)], name, None, False)


def test_dro_requires_beta_and_rejects_unknown_config(engine, trained):
    reference = ReferenceModel(engine.lora_spec(trained), engine.lora_weights(trained))
    data = rl_data(reference, seed=2)
    with pytest.raises(EngineUserError, match="beta"):
        engine.forward_backward(trained, data, "dro", None, False)
    with pytest.raises(EngineUserError, match="clip_low"):
        engine.forward_backward(trained, data, "ppo", {"clip_low": 0.5}, False)
    assert all(g is None for g in engine.lora_grads(trained).values())


def gspo_data(engine, model_id: str, sequence_log_ratio: float, seed: int) -> DatumArrays:
    """One datum whose sampler logprobs make the sequence ratio exp(sequence_log_ratio) over its mask.

    Tokens outside the mask get wildly off sampler logprobs: they must not move the ratio."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 49152, size=13)
    lp = engine.forward_backward(
        model_id, [DatumArrays(tokens[:-1], {"target_tokens": tokens[1:]})], "cross_entropy", None, True
    ).loss_fn_outputs[0]["logprobs"]
    mask = np.ones(12, np.float32)
    mask[:3] = 0.0
    deviations = rng.normal(size=12).astype(np.float32)
    deviations[3:] -= deviations[3:].mean()
    q = lp - deviations - sequence_log_ratio
    q[:3] = lp[:3] + 5.0
    inputs = {
        "target_tokens": tokens[1:],
        "logprobs": q.astype(np.float32),
        "advantages": rng.choice([0.5, 1.0, 2.0], size=12).astype(np.float32),
        "sequence_ratio_mask": mask,
    }
    return DatumArrays(tokens[:-1], inputs)


def test_gspo_every_token_carries_the_sequence_ratio(engine, trained):
    """Unclipped, GSPO-token's value is −s·ΣA and its gradient that of cross_entropy with weights s·A."""
    datum = gspo_data(engine, trained, sequence_log_ratio=0.1, seed=4)
    wide = {"clip_low_threshold": 0.0, "clip_high_threshold": 10.0}
    result = engine.forward_backward(trained, [datum], "gspo", wide, False)
    gspo_grads = engine.lora_grads(trained)
    engine.optim_step(trained, AdamSpec(learning_rate=0.0))
    advantages = datum.loss_fn_inputs["advantages"]
    s = float(np.exp(0.1))
    assert result.metrics["loss:sum"] == pytest.approx(-s * float(advantages.sum()), rel=1e-4)
    np.testing.assert_allclose(result.loss_fn_outputs[0]["elementwise_loss"], -s * advantages, rtol=1e-4)
    weighted = DatumArrays(datum.tokens, {"target_tokens": datum.loss_fn_inputs["target_tokens"], "weights": s * advantages})
    engine.forward_backward(trained, [weighted], "cross_entropy", None, False)
    ce_grads = engine.lora_grads(trained)
    engine.optim_step(trained, AdamSpec(learning_rate=0.0))
    for key, grad in ce_grads.items():
        assert_grad_close(gspo_grads[key], grad, key)


def test_gspo_clips_the_whole_sequence(engine, trained):
    """A sequence ratio above the high bound with positive advantages: value −high·ΣA, no gradient at all."""
    datum = gspo_data(engine, trained, sequence_log_ratio=0.01, seed=6)  # ratio 1.01 > default 1 + 4e-4
    result = engine.forward_backward(trained, [datum], "gspo", None, False)
    grads = engine.lora_grads(trained)
    engine.optim_step(trained, AdamSpec(learning_rate=0.0))
    expected = -(1 + 4e-4) * float(datum.loss_fn_inputs["advantages"].sum())
    assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    assert all(float(g.abs().max()) == 0.0 for g in grads.values())


def test_gspo_needs_a_non_empty_sequence_ratio_mask(engine, trained):
    datum = gspo_data(engine, trained, sequence_log_ratio=0.0, seed=8)
    missing = DatumArrays(datum.tokens, {k: v for k, v in datum.loss_fn_inputs.items() if k != "sequence_ratio_mask"})
    with pytest.raises(EngineUserError, match="sequence_ratio_mask.*missing"):
        engine.forward_backward(trained, [missing], "gspo", None, False)
    empty = DatumArrays(datum.tokens, {**datum.loss_fn_inputs, "sequence_ratio_mask": np.zeros(12, np.float32)})
    with pytest.raises(EngineUserError, match="marks no token"):
        engine.forward_backward(trained, [empty], "gspo", None, False)


def test_gspo_over_datums_laid_end_to_end_equals_gspo_on_each():
    """The engine runs a loss once per micro-batch; GSPO then takes each sequence's ratio from its own tokens."""
    from localtinker.engine.losses import DATUM_OF_TOKEN, gspo

    rng = np.random.default_rng(4)
    config = {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    datums = []
    for length in (3, 6, 1):
        inputs = {key: torch.tensor(rng.normal(size=length), dtype=torch.float32) for key in ("logprobs", "advantages")}
        inputs["sequence_ratio_mask"] = torch.tensor(rng.random(length) < 0.7, dtype=torch.float32)
        inputs["sequence_ratio_mask"][0] = 1.0
        datums.append((torch.tensor(rng.normal(size=length), dtype=torch.float32, requires_grad=True), inputs))
    each = torch.cat([gspo(lp, inputs, config) for lp, inputs in datums])
    joined = {key: torch.cat([inputs[key] for _, inputs in datums]) for key in datums[0][1]}
    joined[DATUM_OF_TOKEN] = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 2])
    lp = torch.cat([lp for lp, _ in datums])
    together = gspo(lp, joined, config)
    torch.testing.assert_close(together, each)
    grads = [torch.autograd.grad(value.sum(), [d[0] for d in datums]) for value in (each, together)]
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs)
    assert not torch.allclose(together, gspo(lp, {k: v for k, v in joined.items() if k != DATUM_OF_TOKEN}, config))
