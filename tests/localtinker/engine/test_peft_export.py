"""Engine LoRA keys <-> PEFT keys, and the adapter directory peft reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from localtinker.engine.api import LoraSpec
from localtinker.engine.peft_export import engine_key, peft_key, write_peft_adapter


def test_keys_round_trip_and_bad_keys_are_named() -> None:
    key = "model.layers.0.self_attn.q_proj.lora_A"
    assert peft_key(key) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert engine_key(peft_key(key)) == key
    with pytest.raises(ValueError, match="model.norm.weight"):
        peft_key("model.norm.weight")
    with pytest.raises(ValueError, match="lm_head.weight"):
        engine_key("lm_head.weight")


def test_adapter_directory_has_peft_config_and_keys(tmp_path: Path) -> None:
    adapter = {"lm_head.lora_A": torch.ones(2, 8), "lm_head.lora_B": torch.zeros(16, 2)}
    write_peft_adapter(tmp_path, adapter, "org/base", LoraSpec(rank=2, train_attn=False, train_mlp=False))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"], config["task_type"]) == (2, 32, "LORA", "CAUSAL_LM")
    assert config["target_modules"] == ["lm_head"] and config["base_model_name_or_path"] == "org/base"
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert set(saved) == {"base_model.model.lm_head.lora_A.weight", "base_model.model.lm_head.lora_B.weight"}


def test_fused_experts_go_as_peft_target_parameters(tmp_path: Path) -> None:
    """An MoE adapter: experts as target_parameters (gate and up as one LoRA of rank 2r, keyed as peft nests its
    wrappers: gate_up_proj innermost), attention as target_modules, no MLP names for linears it does not have."""
    experts, rank, hidden, inter = 3, 2, 8, 4
    path = "model.layers.0.mlp.experts"
    adapter = {"model.layers.0.self_attn.q_proj.lora_A": torch.ones(4 * rank, hidden),
               "model.layers.0.self_attn.q_proj.lora_B": torch.zeros(hidden, 4 * rank)}
    for projection, (out_features, in_features) in {"gate_proj": (inter, hidden), "up_proj": (inter, hidden),
                                                    "down_proj": (hidden, inter)}.items():
        adapter[f"{path}.{projection}.lora_A"] = torch.randn(experts, rank, in_features)
        adapter[f"{path}.{projection}.lora_B"] = torch.randn(experts, out_features, rank)
    write_peft_adapter(tmp_path, adapter, "org/moe", LoraSpec(rank=4 * rank, train_unembed=False))  # 4 experts a token
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert config["rank_pattern"] == {r".*\.mlp\.experts\.gate_up_proj": 2 * rank, r".*\.mlp\.experts\.down_proj": rank}
    assert config["alpha_pattern"] == {r".*\.mlp\.experts\.gate_up_proj": 64, r".*\.mlp\.experts\.down_proj": 32}
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    gate_up_a, gate_up_b = saved[f"base_model.model.{path}.base_layer.lora_A.weight"], saved[f"base_model.model.{path}.base_layer.lora_B.weight"]
    assert gate_up_a.shape == (experts * 2 * rank, hidden) and gate_up_b.shape == (2 * inter, 2 * rank * experts)
    assert saved[f"base_model.model.{path}.lora_A.weight"].shape == (experts * rank, inter)
    # peft's layout: A row e·2r + j, B column j·E + e; expert 1's gate block and its zero off-diagonal block
    torch.testing.assert_close(gate_up_a.view(experts, 2 * rank, hidden)[1, :rank], adapter[f"{path}.gate_proj.lora_A"][1])
    per_expert_b = gate_up_b.view(2 * inter, 2 * rank, experts)[:, :, 1]
    torch.testing.assert_close(per_expert_b[:inter, :rank], adapter[f"{path}.gate_proj.lora_B"][1])
    assert not per_expert_b[:inter, rank:].any() and not per_expert_b[inter:, :rank].any()
