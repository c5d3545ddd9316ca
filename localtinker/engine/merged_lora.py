"""A sampler adapter's LoRA folded into copies of the base weights, for sampling.

Unmerged, every adapted linear of a decode step runs the base product and then two more small ones,
(x Aᵀ)(s·B)ᵀ, added into the output: on SmolLM2-135M that is 211 layers × 2 extra matmuls and a pass
over each output per step, several % of a sampling call (bench/bench_engine_sample.py; docs/engine-notes.md).
A sampler's weights never change, so its adapter can be merged once: W' = W + s·B·A, one product per
layer; a layer's buffer is kept for the next merge, so an RL loop that makes a snapshot per step pays
the page faults once. Where ``packed_linear`` packs
the base layer, only W' packed is kept (W''s buffer is the one kept for the next merge); elsewhere W'.
So a merged adapter holds one copy of the adapted weights, and the kept buffers one more at most.

Only float32: in bfloat16 W' would round the update away (a LoRA delta is orders of magnitude below
the weight it is added to, under bfloat16's 8-bit mantissa), so bfloat16 samplers stay unmerged.
Sampling only: :func:`merged_output` answers inside :func:`~localtinker.engine.packed_linear.packed_sampling`
without autograd; a training adapter is never merged (its weights change every step), and the
trainer's logprobs keep the unmerged function. W' sums in another order than base + delta: logits
move by ~1e-6, within the sampler-trainer agreement the engine states (float32 < 1e-4).
"""

from __future__ import annotations

from typing import Any

import torch

from localtinker.engine.packed_linear import (
    PACKED_ATTR,
    in_packed_sampling,
    pack_frozen_linears,
    pack_weight,
    packed_linear,
)

_MERGED = "_localtinker_merged"  # on a peft LoRA linear: {adapter name: (W', None) or (None, packed W')}
_SPARE = "_localtinker_merge_spare"  # on a peft LoRA linear: a freed W' buffer, reused by the next merge


_LAYERS = "_localtinker_lora_layers"  # on the model: {adapter name: its peft LoRA linears}


def lora_layers(model: torch.nn.Module, name: str) -> list[Any]:
    """The peft LoRA linears adapter ``name`` touches. Remembered on the model: walking every module takes
    milliseconds, and publishing a sampler snapshot asks for the list three times. A
    remembered list is used while each of its layers still holds the adapter (adapter names are never
    reused, and adding another adapter does not change this one's layers)."""
    remembered = model.__dict__.setdefault(_LAYERS, {})
    layers = remembered.get(name)
    if layers is None or not all(name in layer.lora_A for layer in layers):
        layers = [
            module for module in model.modules()
            if isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict) and name in module.lora_A
        ]
        remembered[name] = layers
    return layers


def forget_layers(model: torch.nn.Module, name: str) -> None:
    """Drops the remembered layer list of a deleted adapter."""
    model.__dict__.get(_LAYERS, {}).pop(name, None)


def mergeable(model: torch.nn.Module, name: str) -> bool:
    """True when every layer adapter ``name`` touches is a plain float32 LoRA linear (what :func:`merge` folds)."""
    layers = lora_layers(model, name)
    return bool(layers) and all(
        isinstance(layer.base_layer, torch.nn.Linear)
        and layer.base_layer.weight.dtype == torch.float32
        and layer.lora_A[name].weight.dtype == torch.float32
        and name not in getattr(layer, "lora_variant", {})
        and isinstance(layer.lora_dropout[name], torch.nn.Identity)
        for layer in layers
    )


def merge(model: torch.nn.Module, name: str) -> None:
    """Stores W + s·B·A beside every layer of adapter ``name`` (packed, where the base layer is packed).
    The caller checks :func:`mergeable` first."""
    pack_frozen_linears(model)  # the base layers' packing choices first (once per model), for W' to follow
    with torch.no_grad():
        for layer in lora_layers(model, name):
            base = layer.base_layer.weight
            spare = getattr(layer, _SPARE, None)
            out = spare if spare is not None and spare.shape == base.shape else torch.empty_like(base)
            setattr(layer, _SPARE, None)
            torch.addmm(base, layer.lora_B[name].weight, layer.lora_A[name].weight, alpha=layer.scaling[name], out=out)
            if getattr(layer.base_layer, PACKED_ATTR, None) is not None:
                # Only the packed copy serves; W' itself stays as the buffer of the next merge.
                entry: tuple[torch.Tensor | None, torch.Tensor | None] = (None, pack_weight(out))
                setattr(layer, _SPARE, out)
            else:
                entry = (out, None)
            layer.__dict__.setdefault(_MERGED, {})[name] = entry


def unmerge(model: torch.nn.Module, name: str) -> None:
    """Drops adapter ``name``'s merged weights (each layer keeps one buffer for the next :func:`merge`)."""
    for layer in lora_layers(model, name):
        weight, _ = layer.__dict__.get(_MERGED, {}).pop(name, (None, None))
        if weight is not None and getattr(layer, _SPARE, None) is None:
            setattr(layer, _SPARE, weight)


def is_merged(model: torch.nn.Module, name: str) -> bool:
    layers = lora_layers(model, name)
    return bool(layers) and all(name in layer.__dict__.get(_MERGED, {}) for layer in layers)


def merged_output(layer: Any, name: str, rows: torch.Tensor) -> torch.Tensor | None:
    """``rows`` through adapter ``name``'s merged weight of ``layer``, or None where the unmerged path applies."""
    entry = layer.__dict__.get(_MERGED, {}).get(name)
    if entry is None or torch.is_grad_enabled() or not in_packed_sampling() or rows.dtype != torch.float32:
        return None
    weight, packed = entry
    bias = layer.base_layer.bias
    if packed is None:
        return torch.nn.functional.linear(rows, weight, bias)
    if not rows.numel():  # no rows: any weight of the layer's shape gives the empty output
        return torch.nn.functional.linear(rows, layer.base_layer.weight, bias)
    return packed_linear(rows, packed, bias)
