"""LoRA on fused MoE experts (expert_lora.py): what the family test (peft's own target_parameters LoRA as the
reference) does not reach — bf16 experts with float32 factors, adapters side by side on one experts
module, rounded factors kept only until they change, expert-parallel sentinels, training that learns and
round-trips through a checkpoint, and the other families of the layout (Mixtral, Qwen2-MoE's shared expert)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from localtinker.engine.api import AdamSpec, LoraSpec, SampleSpec
from localtinker.engine.engine import LocalEngine
from localtinker.engine import expert_lora
from localtinker.engine.expert_lora import adapters_of, grouped_possible, unsupported
from tests.localtinker.engine.families import family_dir
from tests.localtinker.engine.test_families import _datum

EXPERTS, HIDDEN, INTER, TOP_K = 4, 64, 32, 2
GPT_OSS_INTER = 24  # gate_up [E, 64, 48]: no square weight hides a transposition


def _experts(dtype: torch.dtype = torch.float32) -> Qwen3MoeExperts:
    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=TOP_K)
    module = Qwen3MoeExperts(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return module.to(dtype)


def _routing(tokens: int = 12, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=generator)
    index = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=generator).softmax(-1)
    return hidden, index, weights


def _reference(module: Qwen3MoeExperts, factors: dict[str, torch.Tensor], scaling: float, hidden, index, weights):
    """Each expert's weights with its LoRA deltas folded in, in float64, applied token by token."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    gate_up, down = module.gate_up_proj.double(), module.down_proj.double()
    delta = {p: scaling * factors[f"{p}.lora_B"].double() @ factors[f"{p}.lora_A"].double()
             for p in ("gate_proj", "up_proj", "down_proj")}
    for token in range(hidden.shape[0]):
        x = hidden[token].double()
        for choice in range(index.shape[1]):
            e = int(index[token, choice])
            w_gate, w_up = gate_up[e].chunk(2, dim=0)
            gate, up = (w_gate + delta["gate_proj"][e]) @ x, (w_up + delta["up_proj"][e]) @ x
            y = (down[e] + delta["down_proj"][e]) @ (torch.nn.functional.silu(gate) * up)
            out[token] += weights[token, choice].double() * y
    return out


def _assert_training_lowers_the_loss(engine: LocalEngine, datum, steps: int) -> None:
    """``steps`` SFT steps of model ``moe`` on ``datum``: its loss falls by more than a nat."""
    losses = []
    for _ in range(steps):
        result = engine.forward_backward("moe", [datum], "cross_entropy", None, False)
        losses.append(-float(result.loss_fn_outputs[0]["logprobs"].sum()))
        engine.optim_step("moe", AdamSpec(learning_rate=0.02))
    assert losses[-1] < losses[0] - 1.0, losses


def _randomize(factors: dict[str, torch.Tensor], seed: int, scale: float = 0.1) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in factors.values():
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * scale)


def test_adapters_side_by_side_each_compute_their_own_experts():
    module = _experts()
    adapters = adapters_of(module)
    adapters.add("a", rank=4, scaling=8.0)
    adapters.add("b", rank=2, scaling=16.0)
    _randomize(adapters.factors["a"], 2)
    _randomize(adapters.factors["b"], 3)
    hidden, index, weights = _routing()
    for name in ("a", "b"):
        adapters.activate(name)
        expected = _reference(module, adapters.factors[name], adapters.scaling[name], hidden, index, weights)
        torch.testing.assert_close(module(hidden, index, weights).double(), expected, atol=1e-6, rtol=1e-5)
    adapters.activate(None)
    base = _reference(module, {k: torch.zeros_like(v) for k, v in adapters.factors["a"].items()}, 0.0, hidden, index, weights)
    torch.testing.assert_close(module(hidden, index, weights).double(), base, atol=1e-6, rtol=1e-5)  # transformers' own
    adapters.delete("a")
    adapters.activate("a")  # gone: the base forward
    torch.testing.assert_close(module(hidden, index, weights).double(), base, atol=1e-6, rtol=1e-5)
    adapters.activate("b")
    expected = _reference(module, adapters.factors["b"], 16.0, hidden, index, weights)
    torch.testing.assert_close(module(hidden, index, weights).double(), expected, atol=1e-6, rtol=1e-5)


def test_bf16_experts_take_float32_masters_and_train_them():
    """With bf16 experts the products run in bf16 (the factors rounded per call) and the gradients reach the
    float32 master factors."""
    module = _experts(torch.bfloat16)
    adapters = adapters_of(module)
    adapters.add("a", rank=4, scaling=8.0)
    _randomize(adapters.factors["a"], 4)
    adapters.activate("a")
    hidden, index, weights = _routing(32)
    hidden = hidden.to(torch.bfloat16)
    out = module(hidden, index, weights)
    assert out.dtype == torch.bfloat16
    expected = _reference(module, adapters.factors["a"], 8.0, hidden, index, weights)
    assert (out.double() - expected).norm() < 0.02 * expected.norm()
    out.float().square().sum().backward()
    for key, factor in adapters.factors["a"].items():
        assert factor.dtype == torch.float32 and factor.grad is not None and factor.grad.abs().max() > 0, key


def test_rounded_factors_follow_an_update_in_place():
    """Without autograd the factors rounded to bf16 are kept; an in-place update (the optimizer's) is seen."""
    module = _experts(torch.bfloat16)
    adapters = adapters_of(module)
    adapters.add("a", rank=4, scaling=8.0)
    _randomize(adapters.factors["a"], 5)
    adapters.activate("a")
    hidden, index, weights = _routing()
    hidden = hidden.to(torch.bfloat16)
    with torch.no_grad():
        before = module(hidden, index, weights)
        assert torch.equal(module(hidden, index, weights), before)
        adapters.factors["a"]["up_proj.lora_B"].add_(0.5)
        after = module(hidden, index, weights)
    assert not torch.equal(after, before)
    torch.testing.assert_close(after, module(hidden, index, weights))  # with autograd: cast per call


def test_a_sentinel_choice_adds_nothing():
    """Expert parallelism marks a choice of another rank's expert with the id past the last: it adds nothing,
    as in transformers' forward."""
    module = _experts()
    adapters = adapters_of(module)
    adapters.add("a", rank=4, scaling=8.0)
    _randomize(adapters.factors["a"], 6)
    adapters.activate("a")
    hidden, index, weights = _routing()
    sentinel = index.clone()
    sentinel[::3, 1] = EXPERTS
    dropped = weights.clone()
    dropped[::3, 1] = 0.0
    torch.testing.assert_close(module(hidden, sentinel, weights), module(hidden, index, dropped))


@pytest.mark.parametrize(("dtype", "rank"), [(torch.float32, 4), (torch.float32, 3), (torch.bfloat16, 4)])
def test_grouped_gemms_equal_the_expert_by_expert_loop(monkeypatch, dtype, rank):
    """The products as grouped GEMMs (one kernel per term for all experts) and expert by expert give the same
    output and gradients, sentinel choices included (the grouped kernel leaves their rows unwritten), with the
    rank padded where its rows are not 16 bytes (3 in float32, 4 in bf16)."""
    from localtinker.engine import expert_lora

    module = _experts(dtype)
    adapters = adapters_of(module)
    adapters.add("a", rank=rank, scaling=8.0)
    _randomize(adapters.factors["a"], 7)
    adapters.activate("a")
    hidden, index, weights = _routing(20)
    index[::4, 0] = EXPERTS
    grouped_calls = []
    grouped_mm = expert_lora.F.grouped_mm
    monkeypatch.setattr(expert_lora.F, "grouped_mm", lambda *a, **k: grouped_calls.append(1) or grouped_mm(*a, **k))

    def run() -> tuple[torch.Tensor, ...]:
        x = hidden.to(dtype).requires_grad_(True)
        out = module(x, index, weights)
        out.float().square().sum().backward()
        grads = tuple(factor.grad.clone() for factor in adapters.factors["a"].values())
        for factor in adapters.factors["a"].values():
            factor.grad = None
        return (out.detach(), x.grad, *grads)

    grouped = run()
    assert len(grouped_calls) == 6  # three terms in each of the two products
    monkeypatch.setattr(expert_lora, "GROUPED", False)
    looped = run()
    assert len(grouped_calls) == 6
    for ours, theirs in zip(grouped, looped):
        if dtype == torch.float32:
            torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
        else:  # bf16 through other kernels: ~1% (the loop is exercised against float64 above)
            assert (ours.float() - theirs.float()).norm() <= 0.05 * theirs.float().norm()
    assert looped[1][::4].abs().max() > 0  # a token with a sentinel choice still has its other choice's gradient


def test_layouts_it_does_not_adapt_are_named():
    module = _experts()
    assert unsupported(module) is None
    module.is_transposed = True  # flagged transposed, shaped as not
    assert unsupported(module) == (f"gate_up_proj {(EXPERTS, 2 * INTER, HIDDEN)} and down_proj {(EXPERTS, HIDDEN, INTER)} "
                                   "are not [E, H, 2I] and [E, I, H]")
    module.is_transposed, module.has_post_expert_norm = False, True
    assert unsupported(module) == "it has a norm after each expert"
    module.has_post_expert_norm, module.has_bias = False, True
    assert unsupported(module) == ("its parameters are ['gate_up_proj', 'down_proj'], not ['gate_up_proj', "
                                   "'gate_up_proj_bias', 'down_proj', 'down_proj_bias']")
    plain = torch.nn.Module()
    plain.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 8, 4))
    assert "parameters are ['gate_up_proj']" in unsupported(plain)


def _gpt_oss_experts() -> torch.nn.Module:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    module = GptOssExperts(GptOssConfig(hidden_size=HIDDEN, intermediate_size=GPT_OSS_INTER, num_local_experts=EXPERTS,
                                        num_experts_per_tok=TOP_K))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)  # large enough to reach the clamps
    return module


def _gpt_oss_reference(module: torch.nn.Module, factors: dict[str, torch.Tensor], scaling: float, hidden, index,
                       weights) -> torch.Tensor:
    """gpt-oss's experts in float64 with each expert's LoRA deltas folded into its transposed weights, gate
    columns at even and up columns at odd positions of gate_up, biases added, then its own clamped gate."""
    delta = {p: scaling * factors[f"{p}.lora_B"].double() @ factors[f"{p}.lora_A"].double()
             for p in ("gate_proj", "up_proj", "down_proj")}  # [E, out, in]
    gate_up = module.gate_up_proj.detach().double().clone()  # [E, H, 2I]
    gate_up[:, :, 0::2] += delta["gate_proj"].transpose(1, 2)
    gate_up[:, :, 1::2] += delta["up_proj"].transpose(1, 2)
    down = module.down_proj.detach().double() + delta["down_proj"].transpose(1, 2)  # [E, I, H]
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for token in range(hidden.shape[0]):
        for choice in range(index.shape[1]):
            e = int(index[token, choice])
            h = hidden[token].double() @ gate_up[e] + module.gate_up_proj_bias[e].detach().double()
            y = module._apply_gate(h) @ down[e] + module.down_proj_bias[e].detach().double()
            out[token] += weights[token, choice].double() * y
    return out


@pytest.mark.parametrize("grouped", [True, False])
def test_gpt_oss_experts_transposed_interleaved_biased_and_clamped(monkeypatch, grouped):
    """gpt-oss's layout (expert_lora.Layout): weights [E, in, out], gate and up interleaved, a bias per expert,
    its clamped SwiGLU. The LoRA forward equals the float64 reference with the deltas folded in, as grouped GEMMs
    and expert by expert; a sentinel choice adds nothing; every factor takes a gradient."""
    from localtinker.engine import expert_lora

    monkeypatch.setattr(expert_lora, "GROUPED", grouped)
    module = _gpt_oss_experts()
    assert unsupported(module) is None
    adapters = adapters_of(module)
    adapters.add("a", rank=3, scaling=8.0)
    _randomize(adapters.factors["a"], 7)
    adapters.activate("a")
    assert adapters.factors["a"]["gate_proj.lora_B"].shape == (EXPERTS, GPT_OSS_INTER, 3)
    assert adapters.factors["a"]["down_proj.lora_A"].shape == (EXPERTS, 3, GPT_OSS_INTER)
    hidden, index, weights = _routing(16)
    expected = _gpt_oss_reference(module, adapters.factors["a"], 8.0, hidden, index, weights)
    out = module(hidden, index, weights)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    pre = hidden @ module.gate_up_proj[0].detach() + module.gate_up_proj_bias[0].detach()
    assert (pre.abs() > module.limit).any()  # the clamps of its gate are reached, so the test covers them
    out.square().sum().backward()
    assert all(factor.grad.abs().max() > 0 for factor in adapters.factors["a"].values())
    index[::3, 1] = EXPERTS  # expert parallelism's sentinel
    kept = torch.where(index < EXPERTS, index, 0)
    expected = _gpt_oss_reference(module, adapters.factors["a"], 8.0, hidden, kept, weights * (index < EXPERTS))
    torch.testing.assert_close(module(hidden, index, weights).double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("portable", [None, True])
def test_experts_alone_learn_and_round_trip_through_a_checkpoint(tmp_path, portable):
    """A Qwen3-MoE trained with LoRA on its experts only (no attention, no unembedding): each expert's rank is
    the adapter's over the experts per token, the loss falls, every expert factor trains, and a checkpoint's
    state gives the same logprobs in a new training client."""
    engine = LocalEngine(tmp_path, dtype="float32", portable=portable)
    lora = LoraSpec(rank=4, seed=0, train_attn=False, train_unembed=False)
    engine.create_model("moe", str(family_dir("qwen3_moe")), lora)
    weights = engine.lora_weights("moe")
    assert {key.rsplit(".", 2)[-2] for key in weights} == {"gate_proj", "up_proj", "down_proj"}
    # each expert's rank: the adapter's 4 over the 2 experts a token goes through
    assert weights["model.layers.0.mlp.experts.gate_proj.lora_A"].shape == (EXPERTS, 2, HIDDEN)
    datum = _datum(np.random.default_rng(0).integers(0, 49152, size=24))
    _assert_training_lowers_the_loss(engine, datum, steps=6)
    assert all(tensor.abs().max() > 0 for key, tensor in engine.lora_weights("moe").items() if key.endswith("lora_B"))
    path = engine.save_state("moe", "trained")
    engine.load_state("moe-again", path, with_optimizer=True, base_model=None)
    first = engine.forward_backward("moe", [datum], "cross_entropy", None, True).loss_fn_outputs[0]["logprobs"]
    again = engine.forward_backward("moe-again", [datum], "cross_entropy", None, True).loss_fn_outputs[0]["logprobs"]
    np.testing.assert_array_equal(first, again)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_other_moe_families_of_the_layout_train_and_sample(tmp_path, family):
    """Mixtral, and Qwen2-MoE whose layers add a shared expert of plain linears (adapted by peft, its experts
    here): the expert LoRA trains (the loss falls) and the sampler's logprobs are the trainer's."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig

    common = dict(vocab_size=49152, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    config = (MixtralConfig(**common, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K) if family == "mixtral" else
              Qwen2MoeConfig(**common, moe_intermediate_size=INTER, shared_expert_intermediate_size=64,
                             num_experts=EXPERTS, num_experts_per_tok=TOP_K))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, 0.05)
    engine = LocalEngine(tmp_path, dtype="float32")
    engine.add_base_model(family, model)
    engine.create_model("moe", family, LoraSpec(rank=4, seed=0))
    mlp = {key.removeprefix("model.layers.0.mlp.") for key in engine.lora_weights("moe") if ".layers.0.mlp." in key}
    expected = {f"experts.{p}.lora_{f}" for p in ("gate_proj", "up_proj", "down_proj") for f in "AB"}
    if family == "qwen2_moe":
        expected |= {f"shared_expert.{p}.lora_{f}" for p in ("gate_proj", "up_proj", "down_proj") for f in "AB"}
    assert mlp == expected
    datum = _datum(np.random.default_rng(0).integers(0, 49152, size=20))
    _assert_training_lowers_the_loss(engine, datum, steps=4)
    engine.create_ephemeral_sampler("sampler", "moe")
    spec = SampleSpec(prompt_tokens=(1, 2, 3), num_samples=2, max_tokens=6, seed=1, stop_token_ids=())
    (sampled,) = engine.sample_batch([("sampler", spec)])
    assert not isinstance(sampled, Exception), sampled
    for sequence in sampled.sequences:
        full = np.array(spec.prompt_tokens + tuple(sequence.tokens))
        trainer = engine.forward_backward("moe", [_datum(full)], "cross_entropy", None, True).loss_fn_outputs[0]["logprobs"]
        np.testing.assert_allclose(sequence.logprobs, trainer[len(spec.prompt_tokens) - 1 :], atol=1e-5, rtol=0)


def test_grouped_gemms_are_taken_on_cards_from_sm80_in_half_dtypes(monkeypatch):
    """The experts' grouped GEMMs on a CUDA card (its compute capability faked: all the decision reads) from sm80
    in bf16/fp16, not on older cards nor in float32 there; on the CPU in any dtype; nowhere once switched off."""
    capability = {"now": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["now"])
    cuda = torch.device("cuda", 0)
    assert grouped_possible(cuda, torch.bfloat16) and grouped_possible(cuda, torch.float16)
    assert not grouped_possible(cuda, torch.float32)
    capability["now"] = (7, 5)
    assert not grouped_possible(cuda, torch.bfloat16)
    assert grouped_possible(torch.device("cpu"), torch.float32)
    monkeypatch.setattr(expert_lora, "GROUPED", False)
    assert not grouped_possible(torch.device("cpu"), torch.float32)
