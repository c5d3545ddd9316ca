"""A Tinker-format adapter turned into the form peft loads, in place: its unembedding and its MoE experts.

Hosted Tinker names the unembedding's LoRA ``model.unembed_tokens`` (tinker-cookbook's merge maps it to
``lm_head``); peft's name is ``lm_head``, which localtinker's downloads use already. Merged, a tied model's head is
untied first (merge.py), so the input embeddings stay the base model's, as in training. Its gpt-oss adapters name
attention ``.attn`` (the original checkpoints' name), transformers ``.self_attn``.

Tinker's adapters (hosted, and localtinker's: ``localtinker/engine/peft_export.py``) carry an MoE layer's expert
LoRA as one 3-D tensor per projection and factor: ``<experts>.gate_proj.lora_A.weight`` [experts, r, in],
``.lora_B.weight`` [experts, out, r] (``w1`` / ``w3`` / ``w2`` in some: gate / up / down), a factor of size 1
in its first dimension shared by every expert, and the config's alpha / rank as the scaling. transformers 5
fuses the experts into ``gate_up_proj`` [experts, 2·inter, hidden] and ``down_proj`` [experts, hidden, inter],
which peft adapts as ``target_parameters`` — one wrapper per parameter, nested, the first registered
innermost, with A [experts·r, in] (expert-major) and B [out, r·experts] (expert-minor). The gate and up LoRAs
become one of their summed rank on ``gate_up_proj`` (localtinker's ``expert_lora.parameter_factors``: A stacked,
B block-diagonal, its rows in the base model's order: interleaved for gpt-oss), and ``rank_pattern`` /
``alpha_pattern`` keep each parameter's rank and the scaling. What the base model's modules are called and how its
experts are laid out is read from the model built on the meta device (:func:`base_layout`: no weights loaded).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file

from localtinker.engine.expert_lora import EXPERT_PARAMETERS, Layout, fused_experts, parameter_factors
from posttrain.export.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, ExportError

_PROJECTIONS = {"gate_proj": "gate_proj", "w1": "gate_proj", "up_proj": "up_proj", "w3": "up_proj",
                "down_proj": "down_proj", "w2": "down_proj"}
_FACTORS = ("lora_A", "lora_B")
_UNEMBED = "base_model.model.model.unembed_tokens."  # hosted Tinker's name for the unembedding's LoRA
_HEAD = "base_model.model.lm_head."
_ATTN, _SELF_ATTN = ".attn.", ".self_attn."  # hosted Tinker's gpt-oss attention name, transformers'


class BaseLayout(NamedTuple):
    """What the conversion needs to know of the base model."""

    self_attn: bool  # its attention modules are ``self_attn`` and none is ``attn``
    interleaved: bool  # its fused experts alternate gate and up outputs (gpt-oss)


def base_layout(base_source: str) -> BaseLayout:
    """The base model's :class:`BaseLayout`, from its config: the model built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_source))
    paths = [path.rpartition(".")[2] for path, _ in model.named_modules()]
    experts = fused_experts(model)
    return BaseLayout("self_attn" in paths and "attn" not in paths,
                      bool(experts) and Layout.of(experts[0][1]).interleaved)


def convert_tinker_adapter(adapter_dir: Path, base: BaseLayout) -> bool:
    """Rewrites ``adapter_dir``'s adapter in the form peft loads on a base model laid out as ``base`` where it is
    in Tinker's (an ``unembed_tokens`` LoRA, ``.attn`` modules, 3-D expert factors); False (untouched) where it
    is peft's already."""
    weights = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    renames_attention = base.self_attn and any(_ATTN in key for key in weights)
    if not (renames_attention or any(tensor.dim() == 3 or key.startswith(_UNEMBED) for key, tensor in weights.items())):
        return False
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    weights, config = unembed_as_head(weights, config)
    if renames_attention:
        weights = {key.replace(_ATTN, _SELF_ATTN): tensor for key, tensor in weights.items()}
    if any(tensor.dim() == 3 for tensor in weights.values()):
        weights, config = experts_as_peft(weights, config, base.interleaved)
    save_file(weights, str(adapter_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (adapter_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return True


def unembed_as_head(weights: dict[str, torch.Tensor], config: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(weights, config) with an ``unembed_tokens`` LoRA named ``lm_head``, as peft names the unembedding."""
    if not any(key.startswith(_UNEMBED) for key in weights):
        return weights, config
    renamed = {(_HEAD + key.removeprefix(_UNEMBED) if key.startswith(_UNEMBED) else key): t for key, t in weights.items()}
    targets = config.get("target_modules")
    if isinstance(targets, list):
        targets = sorted({"lm_head" if name == "unembed_tokens" else name for name in targets} | {"lm_head"})
    return renamed, {**config, "target_modules": targets}


def experts_as_peft(weights: dict[str, torch.Tensor], config: dict,
                    interleaved: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """(weights, config) of an adapter with 3-D expert factors, in peft's ``target_parameters`` form, for experts
    whose gate and up outputs alternate where ``interleaved``."""
    scaling = float(config["lora_alpha"]) / float(config["r"])
    converted: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        if tensor.dim() != 3:
            converted[key] = tensor
            continue
        module, _, factor = key.removesuffix(".weight").rpartition(".")
        path, _, projection = module.rpartition(".")
        if projection not in _PROJECTIONS or factor not in _FACTORS:
            raise ExportError(f"adapter tensor {key} {tuple(tensor.shape)} is not an expert LoRA factor of "
                              f"{sorted(_PROJECTIONS)}: an adapter of another model family?")
        experts.setdefault(path, {})[f"{_PROJECTIONS[projection]}.{factor}"] = tensor
    ranks: dict[str, int] = {}
    for path, factors in experts.items():
        missing = sorted({f"{p}.{f}" for p in ("gate_proj", "up_proj", "down_proj") for f in _FACTORS} - set(factors))
        if missing:
            raise ExportError(f"the adapter's experts at {path} lack {missing}: gate, up and down are converted together")
        count = max(t.shape[0] for t in factors.values())
        factors = {name: t.expand(count, -1, -1) if t.shape[0] == 1 else t for name, t in factors.items()}
        for parameter, (a, b) in parameter_factors(factors, interleaved).items():
            wrapper = path + ".base_layer" * (len(EXPERT_PARAMETERS) - 1 - EXPERT_PARAMETERS.index(parameter))
            converted[f"{wrapper}.lora_A.weight"] = a.reshape(-1, a.shape[-1]).contiguous()  # [E, r, in] -> [E·r, in]
            converted[f"{wrapper}.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()  # [out, r·E]
            target = f"{path.removeprefix('base_model.model.').split('layers.', 1)[-1].partition('.')[2]}.{parameter}"
            if ranks.setdefault(target, a.shape[1]) != a.shape[1]:
                raise ExportError(f"the adapter's {target} LoRAs differ in rank from layer to layer; peft takes one "
                                  "rank per name")
    patterns = {rf".*\.{re.escape(target)}": rank for target, rank in ranks.items()}
    dense = {key.removesuffix(".weight").rpartition(".")[0].rpartition(".")[2]  # the linears' names
             for key, t in converted.items() if t.dim() == 2}
    # A dense MLP's linears beside the experts (DeepSeek's first layers, a shared expert) go as parameters
    # "<name>.weight": in target_modules, peft would turn their names into the experts' (its transformers 5
    # conversion, by model type) and load no LoRA on them. As a parameter, a linear's LoRA is the same product.
    names = config.get("target_modules") or []
    mlp = sorted(name for name in names if name in _PROJECTIONS and name in dense)
    config = {**config,
              "target_modules": sorted(name for name in names if name not in _PROJECTIONS) or None,
              "target_parameters": sorted(ranks) + [f"{name}.weight" for name in mlp],
              "rank_pattern": {**(config.get("rank_pattern") or {}), **patterns},
              "alpha_pattern": {**(config.get("alpha_pattern") or {}),
                                **{pattern: scaling * rank for pattern, rank in patterns.items()}}}
    return converted, config
