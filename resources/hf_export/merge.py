"""Fold a PEFT LoRA adapter into its base model in place: W += (alpha / r) · B A, one module at a time.

The caller's base model is changed where it is (no second copy of it); the adapter is read tensor by tensor.
A LoRA on a tied unembedding unties it first, so the input embeddings keep the base weights as they do in
training.

A LoRA on an MoE layer's fused 3-D expert parameters (peft's ``target_parameters``) adds one delta per expert.
peft nests one wrapper per targeted parameter of a module, the first registered innermost, so the factors of
``<experts>.base_layer`` belong to the first (``gate_up_proj``) and those of ``<experts>`` to the last
(``down_proj``); A is [experts·r, in], B [out, r·experts]; ``rank_pattern`` / ``alpha_pattern`` set a
parameter's own rank and alpha (the gate and up LoRAs fused into one of rank 2r). A transposed parameter
(gpt-oss: [experts, in, out]) takes the delta transposed.
"""

from __future__ import annotations

import json
import re
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
                if config.get("target_parameters") and _merge_parameter(modules, tensors, name, config, base):
                    continue
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


def _merge_parameter(modules: dict, tensors, name: str, config: dict, base: str) -> bool:
    """Adds the LoRA delta of ``name`` (a peft ``target_parameters`` wrapper path) to the 3-D parameter it
    adapts; False when ``name`` is a module's LoRA instead."""
    depth = 0
    while name.endswith(".base_layer"):
        name, depth = name.removesuffix(".base_layer"), depth + 1
    module = modules.get(name)
    if module is None:
        raise ExportError(f"the adapter targets {name!r}, which {base!r} does not have: another base model?")
    targeted = [param for param, tensor in module.named_parameters(recurse=False)
                if tensor.dim() == 3 and any(f"{name}.{param}".endswith(t) for t in config["target_parameters"])]
    if not targeted:
        return False
    if depth >= len(targeted):
        raise ExportError(f"the adapter nests {depth + 1} LoRA wrappers on {name}, which has {len(targeted)} "
                          "targeted parameters")
    param = targeted[len(targeted) - 1 - depth]
    weight = getattr(module, param)
    transposed = bool(getattr(module, "is_transposed", False))  # [E, in, out] (gpt-oss) rather than [E, out, in]
    experts = weight.shape[0]
    in_features, out_features = (weight.shape[1], weight.shape[2]) if transposed else (weight.shape[2], weight.shape[1])
    key = f"{_PREFIX}{name}{'.base_layer' * depth}"
    lora_a = tensors.get_tensor(f"{key}.lora_A.weight").float()
    lora_b = tensors.get_tensor(f"{key}.lora_B.weight").float()
    rank = lora_a.shape[0] // experts
    if lora_a.shape != (experts * rank, in_features) or lora_b.shape != (out_features, rank * experts):
        raise ExportError(
            f"adapter factors for {name}.{param} have shapes {tuple(lora_a.shape)} and {tuple(lora_b.shape)}, "
            f"{base!r} has {tuple(weight.shape)}: the checkpoint was trained on another base model"
        )
    delta = lora_b.view(out_features, rank, experts).permute(2, 0, 1) @ lora_a.view(experts, rank, in_features)
    target = f"{name}.{param}"
    delta *= _pattern(config, "alpha_pattern", "lora_alpha", target) / _pattern(config, "rank_pattern", "r", target)
    weight.copy_((weight.float() + (delta.transpose(1, 2) if transposed else delta)).to(weight.dtype))
    return True


def _pattern(config: dict, patterns: str, default: str, target: str) -> float:
    """A parameter's rank or alpha: the first of ``config[patterns]`` matching it (peft's rule), else the default."""
    for pattern, value in (config.get(patterns) or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", target):
            return float(value)
    return float(config[default])
