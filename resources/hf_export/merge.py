"""Fold a PEFT LoRA adapter into its base model in place: W += (alpha / r) · B A, one module at a time.

The caller's base model is changed where it is (no second copy of it); the adapter is read tensor by tensor.
A LoRA on a tied unembedding unties it first, so the input embeddings keep the base weights as they do in
training.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from posttrain.export.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, ExportError

_PREFIX = "base_model.model."


def merge_into(model: torch.nn.Module, adapter_dir: Path, base: str) -> None:
    """Adds ``adapter_dir``'s LoRA deltas to ``model`` (the base model ``base``, without PEFT layers)."""
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    scale = float(config["lora_alpha"]) / float(config["r"])
    modules = dict(model.named_modules())
    with safe_open(str(adapter_dir / ADAPTER_WEIGHTS), framework="pt") as tensors:
        names = sorted(k.removeprefix(_PREFIX).removesuffix(".lora_A.weight") for k in tensors.keys() if k.endswith(".lora_A.weight"))
        if "lm_head" in names and getattr(model.config, "tie_word_embeddings", False):
            head = model.get_output_embeddings()
            head.weight = torch.nn.Parameter(head.weight.detach().clone())
            model.config.tie_word_embeddings = False
        with torch.no_grad():
            for name in names:
                module = modules.get(name)
                if module is None or not hasattr(module, "weight"):
                    raise ExportError(f"the adapter targets {name!r}, which {base!r} does not have: another base model?")
                lora_a = tensors.get_tensor(f"{_PREFIX}{name}.lora_A.weight").float()
                lora_b = tensors.get_tensor(f"{_PREFIX}{name}.lora_B.weight").float()
                if (lora_b.shape[0], lora_a.shape[1]) != tuple(module.weight.shape):
                    raise ExportError(
                        f"adapter delta for {name} has shape {(lora_b.shape[0], lora_a.shape[1])}, {base!r} has "
                        f"{tuple(module.weight.shape)}: the checkpoint was trained on another base model"
                    )
                if module.weight.dtype == torch.float32:
                    module.weight.addmm_(lora_b, lora_a, alpha=scale)
                else:
                    module.weight.copy_((module.weight.float() + (lora_b @ lora_a) * scale).to(module.weight.dtype))
