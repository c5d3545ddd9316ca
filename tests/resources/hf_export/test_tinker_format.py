"""Tinker-format adapters into the form peft loads: the ``unembed_tokens`` name hosted Tinker gives the
unembedding (checked end to end: peft and the merged model compute what the engine computed), and expert LoRA
(3-D factors per projection) into peft's target_parameters form — the layout peft reads, Tinker's other names
and shared factors, and clear errors for what cannot be converted. That peft then computes the engine's function
for experts is checked by test_families.py (Qwen3-MoE) and test_export.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from posttrain.export.adapter import ExportError
from resources.hf_export.tinker_format import (
    BaseLayout, base_layout, convert_tinker_adapter, experts_as_peft, unembed_as_head,
)

EXPERTS, RANK, HIDDEN, INTER = 3, 2, 8, 4
PATH = "base_model.model.model.layers.0.mlp.experts"
CONFIG = {"r": 8, "lora_alpha": 32, "target_modules": ["q_proj", "gate_proj", "up_proj", "down_proj"]}
PLAIN = BaseLayout(self_attn=True, interleaved=False)  # a Llama-shaped base model


def _adapter(names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    adapter = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(8, HIDDEN)}
    for name, (out_features, in_features) in zip(names, ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))):
        adapter[f"{PATH}.{name}.lora_A.weight"] = torch.randn(EXPERTS, RANK, in_features, generator=generator)
        adapter[f"{PATH}.{name}.lora_B.weight"] = torch.randn(EXPERTS, out_features, RANK, generator=generator)
    return adapter


def test_peft_layout_ranks_and_scaling():
    adapter = _adapter()
    weights, config = experts_as_peft(adapter, CONFIG)
    assert config["target_modules"] == ["q_proj"]  # no MLP linears in this model: peft would convert the names
    assert config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert config["rank_pattern"] == {r".*\.mlp\.experts\.gate_up_proj": 2 * RANK, r".*\.mlp\.experts\.down_proj": RANK}
    # the adapter's scaling 32 / 8 for every expert LoRA: alpha = 4 · rank
    assert config["alpha_pattern"] == {r".*\.mlp\.experts\.gate_up_proj": 16.0, r".*\.mlp\.experts\.down_proj": 8.0}
    gate_up_a, gate_up_b = weights[f"{PATH}.base_layer.lora_A.weight"], weights[f"{PATH}.base_layer.lora_B.weight"]
    assert gate_up_a.shape == (EXPERTS * 2 * RANK, HIDDEN) and gate_up_b.shape == (2 * INTER, 2 * RANK * EXPERTS)
    assert weights[f"{PATH}.lora_A.weight"].shape == (EXPERTS * RANK, INTER)
    # peft's layout: A row e·2r + j, B column j·E + e; expert 1's gate block, up block, zero off-diagonal blocks
    torch.testing.assert_close(gate_up_a.view(EXPERTS, 2 * RANK, HIDDEN)[1, RANK:], adapter[f"{PATH}.up_proj.lora_A.weight"][1])
    per_expert_b = gate_up_b.view(2 * INTER, 2 * RANK, EXPERTS)[:, :, 1]
    torch.testing.assert_close(per_expert_b[:INTER, :RANK], adapter[f"{PATH}.gate_proj.lora_B.weight"][1])
    torch.testing.assert_close(per_expert_b[INTER:, RANK:], adapter[f"{PATH}.up_proj.lora_B.weight"][1])
    assert not per_expert_b[:INTER, RANK:].any() and not per_expert_b[INTER:, :RANK].any()
    delta = weights[f"{PATH}.lora_B.weight"].view(HIDDEN, RANK, EXPERTS)[:, :, 2] @ weights[f"{PATH}.lora_A.weight"].view(
        EXPERTS, RANK, INTER)[2]
    expected = adapter[f"{PATH}.down_proj.lora_B.weight"][2] @ adapter[f"{PATH}.down_proj.lora_A.weight"][2]
    torch.testing.assert_close(delta, expected)


def test_dense_mlp_linears_beside_experts_go_as_parameters_peft_does_not_convert():
    """A shared expert's (or a dense first layer's) gate/up/down linears keep their LoRA as target_parameters
    ``<name>.weight``: as target_modules names, peft's transformers 5 conversion for DeepSeek's model types (and
    GLM-4 MoE's, ERNIE 4.5 MoE's, ...) would turn them into the experts' parameters and load no LoRA on them. (That peft then loads such
    an adapter as the engine trained it: test_families.py, DeepSeek-V3 with a dense layer and shared experts.)"""
    adapter = _adapter()
    shared = "base_model.model.model.layers.0.mlp.shared_experts"
    adapter.update({f"{shared}.gate_proj.lora_A.weight": torch.ones(8, HIDDEN),
                    f"{shared}.gate_proj.lora_B.weight": torch.ones(INTER, 8)})
    weights, config = experts_as_peft(adapter, CONFIG)
    assert config["target_modules"] == ["q_proj"]
    assert config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj", "gate_proj.weight"]
    assert weights[f"{shared}.gate_proj.lora_A.weight"] is adapter[f"{shared}.gate_proj.lora_A.weight"]


def test_w1_w3_w2_names_and_shared_factors_convert_alike():
    adapter = _adapter()
    renamed = {key.replace(".gate_proj.", ".w1.").replace(".up_proj.", ".w3.").replace(".down_proj.", ".w2."): t
               for key, t in adapter.items()}
    shared = dict(adapter)
    shared[f"{PATH}.gate_proj.lora_A.weight"] = adapter[f"{PATH}.gate_proj.lora_A.weight"][:1]  # one A for all experts
    expected = dict(adapter)
    expected[f"{PATH}.gate_proj.lora_A.weight"] = adapter[f"{PATH}.gate_proj.lora_A.weight"][:1].expand(EXPERTS, -1, -1)
    for variant, reference in ((renamed, adapter), (shared, expected)):
        ours, _ = experts_as_peft(variant, CONFIG)
        theirs, _ = experts_as_peft(reference, CONFIG)
        assert ours.keys() == theirs.keys()
        for key in ours:
            torch.testing.assert_close(ours[key], theirs[key])


def test_what_cannot_be_converted_is_named(tmp_path: Path):
    partial = {k: t for k, t in _adapter().items() if ".up_proj." not in k}
    with pytest.raises(ExportError, match=r"lack \['up_proj.lora_A', 'up_proj.lora_B'\]"):
        experts_as_peft(partial, CONFIG)
    odd = {**_adapter(), f"{PATH}.router.lora_A.weight": torch.zeros(EXPERTS, RANK, HIDDEN)}
    with pytest.raises(ExportError, match="router.lora_A.weight .* not an expert LoRA factor"):
        experts_as_peft(odd, CONFIG)
    dense = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(8, HIDDEN)}
    save_file(dense, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(CONFIG))
    assert not convert_tinker_adapter(tmp_path, PLAIN)  # peft's form already: the files stay as they are
    assert load_file(str(tmp_path / "adapter_model.safetensors")).keys() == dense.keys()
    assert json.loads((tmp_path / "adapter_config.json").read_text()) == CONFIG


def test_a_hosted_unembed_tokens_lora_loads_in_peft_and_merges_as_the_engine_computes(tmp_path: Path):
    """An adapter with its unembedding LoRA under hosted Tinker's name, on a tied model: converted, peft loads it
    and computes the engine's logprobs, and the merged model (its head untied) does too."""
    import numpy as np
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from localtinker.engine.api import DatumArrays, LoraSpec
    from localtinker.engine.engine import LocalEngine
    from localtinker.engine.models import tiny_random_dir
    from localtinker.engine.peft_export import write_peft_adapter
    from resources.hf_export.merge import merge_into

    base = str(tiny_random_dir())
    engine = LocalEngine(tmp_path / "engine", dtype="float32")
    spec = LoraSpec(rank=4, seed=0)
    engine.create_model("m", base, spec)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, param in engine._models["m"].params.items():
            if key.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    tokens = np.random.default_rng(0).integers(0, 1000, size=12)
    datum = DatumArrays(tokens=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:], "weights": np.ones(11, np.float32)})
    ours = engine.forward_backward("m", [datum], "cross_entropy", None, True).loss_fn_outputs[0]["logprobs"]
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    write_peft_adapter(adapter, engine.lora_weights("m"), base, spec)
    hosted = {key.replace("base_model.model.lm_head.", "base_model.model.model.unembed_tokens."): t
              for key, t in load_file(str(adapter / "adapter_model.safetensors")).items()}
    assert any(".unembed_tokens." in key for key in hosted)
    save_file(hosted, str(adapter / "adapter_model.safetensors"))
    assert convert_tinker_adapter(adapter, base_layout(base))
    assert "lm_head" in json.loads((adapter / "adapter_config.json").read_text())["target_modules"]

    def logprobs(model: torch.nn.Module) -> np.ndarray:
        logits = model(input_ids=torch.as_tensor(tokens[:-1])[None]).logits[0]
        return logits.log_softmax(-1).gather(-1, torch.as_tensor(tokens[1:])[:, None]).squeeze(-1).detach().numpy()

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    np.testing.assert_allclose(logprobs(loaded), ours, atol=1e-5)
    merged = loaded.unload()
    merge_into(merged, adapter, base)
    np.testing.assert_allclose(logprobs(merged), ours, atol=1e-4)
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    assert np.abs(logprobs(plain) - ours).max() > 1e-3  # the adapter, the head's LoRA with it, changes them


def test_unembed_tokens_is_renamed_in_keys_and_targets():
    weights = {"base_model.model.model.unembed_tokens.lora_A.weight": torch.ones(2, 8),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 8)}
    renamed, config = unembed_as_head(weights, {"target_modules": ["q_proj", "unembed_tokens"]})
    assert set(renamed) == {"base_model.model.lm_head.lora_A.weight", "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"}
    assert config["target_modules"] == ["lm_head", "q_proj"]


def test_hosted_gpt_oss_attention_names_and_the_base_layout(tmp_path: Path):
    """The base model's layout is read from its config (no weights): gpt-oss's experts interleave gate and up, a
    Qwen3-MoE's do not. Hosted Tinker's ``.attn`` (gpt-oss's original name) becomes transformers' ``.self_attn``
    where the base model has that and no ``attn``; elsewhere names stay."""
    from tests.localtinker.engine.families import family_dir

    assert base_layout(str(family_dir("gpt_oss"))) == BaseLayout(self_attn=True, interleaved=True)
    assert base_layout(str(family_dir("qwen3_moe"))) == BaseLayout(self_attn=True, interleaved=False)
    hosted = {"base_model.model.model.layers.0.attn.q_proj.lora_A.weight": torch.ones(8, HIDDEN),
              "base_model.model.model.layers.0.attn.q_proj.lora_B.weight": torch.ones(HIDDEN, 8)}
    for base, expected in ((PLAIN, ".self_attn."), (BaseLayout(self_attn=False, interleaved=False), ".attn.")):
        save_file(hosted, str(tmp_path / "adapter_model.safetensors"))
        (tmp_path / "adapter_config.json").write_text(json.dumps(CONFIG))
        assert convert_tinker_adapter(tmp_path, base) == (expected == ".self_attn.")
        assert all(expected in key for key in load_file(str(tmp_path / "adapter_model.safetensors")))
