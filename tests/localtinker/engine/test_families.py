"""The model families Tinker users train, each a tiny random model of its class (families.py): the trainer's
logprobs and LoRA gradients equal transformers + peft's own forward (``ForCausalLM.forward``, soft caps and
sliding windows included), and sampler logprobs equal the trainer's, on the CPU's default path and on the
portable path (the CUDA path's code, run here on the CPU), with either of its samplers. Qwen3-MoE's experts
carry LoRA too (expert_lora.py): its reference is peft's own ``target_parameters`` LoRA, loaded by
``PeftModel.from_pretrained`` from the adapter the engine exports, in the form the project's export gives it
(resources/hf_export/tinker_format.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from localtinker.engine.api import AdamSpec, DatumArrays, EngineUserError, LoraSpec, SampleSpec
from localtinker.engine.engine import LocalEngine
from localtinker.engine.families import layer_windows
from localtinker.engine.lora import LORA_ALPHA, peft_targets_as_named, target_module_names
from localtinker.engine.peft_export import peft_key, write_peft_adapter
from resources.hf_export.tinker_format import base_layout, convert_tinker_adapter, experts_as_peft
from tests.localtinker.engine.families import BROUGHT_FAMILIES, FAMILIES, SLIDING_FAMILIES, family_dir

LORA = LoraSpec(rank=4, seed=0)
TOLERANCE = 1e-5  # float32


@pytest.fixture(scope="module", params=["default", "portable", "cuda-path"])
def engine(request, tmp_path_factory) -> LocalEngine:
    """The CPU's default path, the portable path with transformers' layers, and the portable path as a GPU runs
    it, uncompiled: training through the written-out layers (packed_layers.py), decoding over the static cache
    (static_decode.py)."""
    portable = True if request.param != "default" else None
    gpu_like = request.param == "cuda-path"
    return LocalEngine(tmp_path_factory.mktemp(f"families-{request.param}"), dtype="float32", portable=portable,
                       static_decode=gpu_like, train_layers=gpu_like)


def _datum(tokens: np.ndarray) -> DatumArrays:
    return DatumArrays(tokens=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:],
                                                            "weights": np.ones(len(tokens) - 1, np.float32)})


def _random_lora(engine: LocalEngine, model_id: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    weights = {key: torch.randn(value.shape, generator=generator) * 0.05 for key, value in engine.lora_weights(model_id).items()}
    engine._hosts[engine._models[model_id].base_name].adapters.import_weights(engine._models[model_id].adapter, weights)
    return weights


def _reference(family: str, lora: LoraSpec, weights: dict[str, torch.Tensor], tmp_path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(family_dir(family), dtype=torch.float32)
    if any(tensor.dim() == 3 for tensor in weights.values()):  # fused experts: peft's target_parameters LoRA
        write_peft_adapter(tmp_path, weights, str(family_dir(family)), lora)
        assert convert_tinker_adapter(tmp_path, base_layout(str(family_dir(family))))
        return PeftModel.from_pretrained(model, tmp_path, is_trainable=True)  # as a user loads it
    with peft_targets_as_named():  # as the engine adapts them: the names, not peft's MoE conversion of them
        peft_model = get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=LORA_ALPHA,
                                                      target_modules=target_module_names(lora)))
    named = dict(peft_model.named_parameters())
    with torch.no_grad():
        for key, value in weights.items():
            module, _, kind = key.rpartition(".")
            named[f"base_model.model.{module}.{kind}.default.weight"].copy_(value)
    return peft_model


def _peft_grads(grads: dict[str, torch.Tensor], reference: torch.nn.Module, lora: LoraSpec,
                family: str) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(key, ours, peft's) per PEFT tensor. Where the engine's gate and up LoRAs go as one block-diagonal LoRA,
    peft's off-diagonal entries (zeros the engine does not train) are left out of the comparison."""
    named = dict(reference.named_parameters())
    config = {"r": lora.rank, "lora_alpha": LORA_ALPHA, "target_modules": target_module_names(lora)}
    interleaved = base_layout(str(family_dir(family))).interleaved
    ours_named = {peft_key(key): grad.cpu() for key, grad in grads.items()}
    trained = experts_as_peft({key: torch.ones_like(grad) for key, grad in ours_named.items()}, config, interleaved)[0]
    pairs = []
    for key, ours in experts_as_peft(ours_named, config, interleaved)[0].items():
        theirs = named[key.removesuffix(".weight") + ".default.weight"].grad
        pairs.append((key, ours, theirs * (trained[key] != 0)))
    return pairs


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_and_sampler_equal_the_models_own_forward(engine, family, tmp_path):
    check_family(engine, family, TOLERANCE, tmp_path)


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
def test_sliding_windows_on_the_gpu_path(family, tmp_path):
    """Mistral v0.1's window on every layer and Qwen2's on some (8 tokens here), on the portable path as a GPU
    runs it: sampling over the static cache and training through the written-out layers each mask every layer's
    own window (sequences, prompts and samples reach past it). (The CPU's default and portable paths run
    transformers' attention for such models: the test above.)"""
    engine = LocalEngine(tmp_path / "engine", dtype="float32", portable=True, static_decode=True, train_layers=True)
    check_family(engine, family, TOLERANCE, tmp_path)
    model = engine._hosts[str(family_dir(family))].base.model
    windows = layer_windows(model.config)
    decoders = model.__dict__.get("_localtinker_static_decoders", [])
    assert 8 in windows and decoders and all(decoder.windows == windows for decoder in decoders)


@pytest.mark.parametrize("family", BROUGHT_FAMILIES)
def test_models_brought_from_the_hub_equal_their_own_forward(family, tmp_path):
    """Beyond the families Tinker hosts, one of each kind of difference: Granite divides its logits by 4 and
    Cohere 2 multiplies them by 1/4 (folded into the final norm at load: output_head.py); MiniCPM3 (which also
    scales its logits) and DeepSeek-V3 (a dense layer, then routed and shared experts) attend through low-rank
    latents; Falcon's attention modules bypass transformers' attention interface; Phi-3's projections are fused
    (qkv, gate/up) and StarCoder2's MLP is c_fc / c_proj, names of their own. On the CPU's default engine each
    trains and samples as its own forward, every projection carries LoRA, its LoRA gradients are peft's on the
    model as saved (an exported adapter, loaded by plain peft, is the one trained), and the four the CPU path's
    attention does not cover (Cohere 2's sliding layer, latent attention, Falcon's own modules) run the portable
    path."""
    engine = LocalEngine(tmp_path / "engine", dtype="float32")
    if family in ("phi3", "falcon", "deepseek_v3_moe", "starcoder2"):  # every projection carries LoRA
        engine.create_model("names", str(family_dir(family)), LORA)
        keys = list(engine.lora_weights("names"))
        adapted = {key.rsplit(".", 2)[-2] for key in keys}
        engine.unload_model("names")
        if family == "deepseek_v3_moe":  # the dense layer's MLP, the shared experts and the routed ones
            adapted_paths = {key.split("model.", 1)[-1].rsplit(".", 1)[0] for key in keys}
            assert {"layers.0.mlp.gate_proj", "layers.1.mlp.shared_experts.gate_proj",
                    "layers.1.mlp.experts.gate_proj"} <= adapted_paths
        assert adapted >= {"phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
                           "falcon": {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"},
                           "starcoder2": {"q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"},
                           "deepseek_v3_moe": {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                               "gate_proj", "up_proj", "down_proj"}}[family]
    check_family(engine, family, TOLERANCE, tmp_path)
    portable = engine._hosts[str(family_dir(family))].base.portable
    assert portable == (family in ("cohere2", "minicpm3", "deepseek_v3_moe", "falcon"))  # cohere2: its sliding layer


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3_moe"])
def test_expert_lora_equals_the_weights_it_merges_into(family, tmp_path):
    """An MoE adapter as the weights it stands for: every linear's W + s·B·A and every expert's gate, up and down
    rows + s·B_e·A_e (s the adapter's alpha / rank, as tinker-cookbook merges them), merged into the model as
    saved, give the engine's logprobs: a reference independent of peft and of the export's conversion, for
    Qwen3-MoE and DeepSeek-V3 (grouped top-k routing with a score-correction bias, shared experts beside the
    routed ones, a dense first layer)."""
    engine = LocalEngine(tmp_path / "engine", dtype="float32")
    directory = str(family_dir(family))
    engine.create_model("moe", directory, LORA)
    weights = _random_lora(engine, "moe")
    assert {key.rsplit(".", 2)[-2] for key, tensor in weights.items() if tensor.dim() == 3} == {
        "gate_proj", "up_proj", "down_proj"}
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    params, scaling = dict(reference.named_parameters()), LORA_ALPHA / LORA.rank
    with torch.no_grad():
        for key, a in weights.items():
            if not key.endswith(".lora_A"):
                continue
            module, b = key.removesuffix(".lora_A"), weights[key.removesuffix("lora_A") + "lora_B"]
            if a.dim() == 2:  # a new parameter: a tied unembedding's LoRA is the unembedding's alone
                linear = reference.get_submodule(module)
                linear.weight = torch.nn.Parameter(linear.weight.detach() + scaling * b @ a)
                continue
            holder, projection = module.rsplit(".", 1)
            delta = scaling * torch.bmm(b, a)  # [experts, out, in], as transformers keeps gate_up_proj, down_proj
            if projection == "down_proj":
                params[f"{holder}.down_proj"].add_(delta)
            else:
                rows = delta.shape[1]
                gate_up = params[f"{holder}.gate_up_proj"]
                (gate_up[:, :rows] if projection == "gate_proj" else gate_up[:, rows:]).add_(delta)
    sequence = np.random.default_rng(0).integers(0, 49152, size=24)
    result = engine.forward_backward("moe", [_datum(sequence)], "cross_entropy", None, True)
    with torch.no_grad():
        logits = reference(input_ids=torch.as_tensor(sequence[:-1])[None]).logits[0]
    expected = logits.log_softmax(-1).gather(-1, torch.as_tensor(sequence[1:])[:, None]).squeeze(-1)
    np.testing.assert_allclose(result.loss_fn_outputs[0]["logprobs"], expected.numpy(), atol=TOLERANCE, rtol=0)


def check_family(engine: LocalEngine, family: str, tolerance: float, tmp_path) -> None:
    """Trainer logprobs and LoRA gradients against transformers + peft on the CPU in float32, and the sampler's
    logprobs (and prompt logprobs) against the trainer's, within ``tolerance`` (gradients 10×, of their scale)."""
    model_id = f"families:train:{family}"
    directory = str(family_dir(family))
    lora = LORA
    info = engine.create_model(model_id, directory, lora)
    config = AutoConfig.from_pretrained(directory)
    assert (info.arch, info.max_context_length) == (config.model_type, config.max_position_embeddings)
    weights = _random_lora(engine, model_id)
    reference = _reference(family, lora, weights, tmp_path)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 49152, size=n) for n in (6, 20, 31)]  # past the sliding windows (8)
    result = engine.forward_backward(model_id, [_datum(s) for s in sequences], "cross_entropy", None, False)
    total = 0.0
    for sequence, output in zip(sequences, result.loss_fn_outputs):
        logits = reference(input_ids=torch.as_tensor(sequence[:-1])[None]).logits[0].float()
        expected = logits.log_softmax(-1).gather(-1, torch.as_tensor(sequence[1:])[:, None]).squeeze(-1)
        np.testing.assert_allclose(output["logprobs"], expected.detach().numpy(), atol=tolerance, rtol=0)
        total = total - expected.sum()
    total.backward()
    for key, grad, expected_grad in _peft_grads(engine.lora_grads(model_id), reference, lora, family):
        # float32 rounding of sums over tokens grows with the gradient's scale (Gemma's embeddings are ×√hidden)
        scale = max(1.0, float(expected_grad.abs().max()))
        torch.testing.assert_close(grad, expected_grad, atol=10 * tolerance * scale, rtol=10 * tolerance, msg=key)

    path = engine.save_sampler_weights(model_id, "families")
    engine.create_sampler(f"families-{family}", None, path)
    prompts = [tuple(int(t) for t in rng.integers(0, 49152, size=n)) for n in (5, 9)]
    specs = [SampleSpec(prompt_tokens=p, num_samples=2, max_tokens=12, seed=7, stop_token_ids=(), prompt_logprobs=True)
             for p in prompts]
    results = engine.sample_batch([(f"families-{family}", spec) for spec in specs])
    for prompt, sampled in zip(prompts, results):
        assert not isinstance(sampled, Exception), sampled
        for sequence in sampled.sequences:
            assert len(sequence.tokens) == 12
            full = np.array(prompt + tuple(sequence.tokens))
            trainer = engine.forward_backward(model_id, [_datum(full)], "cross_entropy", None, True)
            logprobs = trainer.loss_fn_outputs[0]["logprobs"]
            np.testing.assert_allclose(sequence.logprobs, logprobs[len(prompt) - 1 :], atol=tolerance, rtol=0)
            np.testing.assert_allclose(sampled.prompt_logprobs[1:], logprobs[: len(prompt) - 1], atol=tolerance, rtol=0)
    engine.unload_model(model_id)


def test_layer_windows_are_read_as_transformers_masks_apply_them():
    """A window no position reaches (Mistral's 4096 in a 4096 context) and Qwen2's window while
    ``use_sliding_window`` is off are none; a layer type that is no window (Llama 4's chunks) is refused."""
    from types import SimpleNamespace

    from transformers import MistralConfig, Qwen2Config

    assert layer_windows(MistralConfig(num_hidden_layers=3, sliding_window=4096, max_position_embeddings=32768)) == [4096] * 3
    assert layer_windows(MistralConfig(num_hidden_layers=3, sliding_window=4096, max_position_embeddings=4096)) == [None] * 3
    assert layer_windows(Qwen2Config(num_hidden_layers=2, sliding_window=4096, use_sliding_window=False)) == [None] * 2
    chunked = SimpleNamespace(num_hidden_layers=2, layer_types=["chunked_attention", "full_attention"],
                              sliding_window=None, max_position_embeddings=8192)
    with pytest.raises(ValueError, match="chunked_attention"):
        layer_windows(chunked)


def test_gemma_soft_cap_bounds_the_logits(engine):
    """The final-logit cap is applied: no logprob of a capped model falls below −2·cap − log(vocab)."""
    engine.create_model("families:train:cap", str(family_dir("gemma2")), LORA)
    tokens = np.random.default_rng(1).integers(0, 49152, size=12)
    logprobs = engine.forward_backward("families:train:cap", [_datum(tokens)], "cross_entropy", None, True)
    cap = AutoConfig.from_pretrained(family_dir("gemma2")).final_logit_softcapping
    assert logprobs.loss_fn_outputs[0]["logprobs"].min() >= -2 * cap - np.log(49152) - 1e-4


def test_moe_experts_of_another_layout_are_refused_by_name(engine):
    """Experts whose layout expert_lora.py does not adapt (here: a norm after each expert, as transformers flags
    it): a clear error naming the module, what is different and the way out; attention-only LoRA still trains on
    that model."""
    model = AutoModelForCausalLM.from_pretrained(family_dir("qwen3_moe"), dtype=torch.float32)
    for layer in model.model.layers:
        layer.mlp.experts.has_post_expert_norm = True
    engine.add_base_model("families/moe-normed", model)
    with pytest.raises(EngineUserError, match=r"model\.layers\.0\.mlp\.experts, Qwen3MoeExperts\).*a norm after each "
                                              r"expert.*train_mlp=False"):
        engine.create_model("families:train:moe-normed", "families/moe-normed", LORA)
    engine.create_model("families:train:moe-attention", "families/moe-normed", LoraSpec(rank=4, seed=0, train_mlp=False))
    assert not any(tensor.dim() == 3 for tensor in engine.lora_weights("families:train:moe-attention").values())
    engine.unload_model("families:train:moe-attention")


def test_mxfp4_experts_load_dequantized_and_train(engine):
    """gpt-oss as the hub has it (experts in MXFP4: families.mxfp4_family_dir) loads as plain fused experts whose
    weights are the checkpoint's codes × their blocks' powers of two, which LoRA trains. On a CPU transformers
    dequantizes by itself; on a GPU with Triton and the ``kernels`` package it would keep MXFP4 experts no LoRA
    reaches, so the engine asks for the dequantized weights everywhere (families.load_options)."""
    from safetensors.torch import load_file
    from transformers import Mxfp4Config

    from localtinker.engine.families import load_options
    from tests.localtinker.engine.families import _FP4_VALUES, mxfp4_family_dir

    directory = mxfp4_family_dir()
    option = load_options(AutoConfig.from_pretrained(directory))["quantization_config"]
    assert isinstance(option, Mxfp4Config) and option.dequantize
    assert load_options(AutoConfig.from_pretrained(family_dir("gpt_oss"))) == {}
    engine.create_model("families:train:mxfp4", str(directory), LORA)
    model = engine._hosts[engine._models["families:train:mxfp4"].base_name].base.model
    experts = model.model.layers[1].mlp.experts
    assert type(experts).__name__ == "GptOssExperts" and experts.gate_up_proj.dtype == torch.float32
    saved = load_file(str(directory / "model.safetensors"))
    blocks, scales = (saved[f"model.layers.1.mlp.experts.down_proj_{part}"] for part in ("blocks", "scales"))
    table = torch.tensor(_FP4_VALUES + tuple(-v for v in _FP4_VALUES))
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).flatten(-2).long()  # low nibble first
    values = table[codes] * torch.exp2(scales.float() - 127)[..., None]  # [E, out, in / 32, 32]
    torch.testing.assert_close(experts.down_proj.detach(), values.flatten(-2).transpose(1, 2), atol=0, rtol=0)
    tokens = np.random.default_rng(2).integers(0, 49152, size=16)
    losses = []
    for _ in range(4):
        result = engine.forward_backward("families:train:mxfp4", [_datum(tokens)], "cross_entropy", None, False)
        losses.append(-float(result.loss_fn_outputs[0]["logprobs"].sum()))
        engine.optim_step("families:train:mxfp4", AdamSpec(learning_rate=0.01))
    assert losses[-1] < losses[0] - 1.0, losses
    engine.unload_model("families:train:mxfp4")
