"""Fold a PEFT LoRA adapter into its base model: W += (alpha / r) · B A, one module at a time.

The base is loaded once and changed in place (no second copy of it); the adapter is read tensor by tensor.
A LoRA on a tied unembedding unties it first, so the input embeddings keep the base weights as they do in
training. The result is a plain Hugging Face directory: safetensors, config, tokenizer with chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, ExportError

_PREFIX = "base_model.model."


def merge_adapter(base: str, adapter_dir: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> None:
    """Writes the merged model of ``base`` (a directory or hub id) + ``adapter_dir`` into ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    scale = float(config["lora_alpha"]) / float(config["r"])
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
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
                delta = (lora_b @ lora_a) * scale
                if delta.shape != module.weight.shape:
                    raise ExportError(
                        f"adapter delta for {name} has shape {tuple(delta.shape)}, {base!r} has "
                        f"{tuple(module.weight.shape)}: the checkpoint was trained on another base model"
                    )
                module.weight.copy_((module.weight.float() + delta).to(module.weight.dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(out_dir)  # tokenizer files and its chat template
