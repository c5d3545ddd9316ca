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


def test_fused_experts_are_written_as_tinker_writes_them(tmp_path: Path) -> None:
    """An MoE adapter's expert factors keep their 3-D form under their projections' names (what tinker-cookbook's
    weight tools read), the config's rank and alpha the adapter's."""
    path = "model.layers.0.mlp.experts"
    adapter = {f"{path}.gate_proj.lora_A": torch.randn(3, 2, 8), f"{path}.gate_proj.lora_B": torch.randn(3, 4, 2),
               "model.layers.0.self_attn.q_proj.lora_A": torch.ones(8, 8)}
    write_peft_adapter(tmp_path, adapter, "org/moe", LoraSpec(rank=8, train_unembed=False))
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert saved[f"base_model.model.{path}.gate_proj.lora_A.weight"].shape == (3, 2, 8)
    assert saved[f"base_model.model.{path}.gate_proj.lora_B.weight"].shape == (3, 4, 2)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 32) and sorted(config["target_modules"]) == ["gate_proj", "q_proj"]
