"""A starting learning rate for LoRA fine-tuning (Tinker's published heuristic).

``LR = 5e-5 * 10 * (2000 / hidden_size) ** exponent``: 5e-5 is a full fine-tuning base rate, LoRA
wants about 10x more, and smaller models tolerate larger rates with a family-specific exponent
(0.781 for Llama-architecture models, SmolLM2 included; 0.0775 for Qwen). A starting point for a sweep,
not a guarantee.
"""

from __future__ import annotations

import json
from pathlib import Path

BASE_FULL_FINETUNE_LR = 5e-5
LORA_LR_MULTIPLIER = 10.0
FAMILY_EXPONENTS = {"llama": 0.781, "qwen": 0.0775}


def model_family(model_name: str) -> str:
    """"qwen" for Qwen models, "llama" for everything else (Llama, SmolLM2 and other Llama-like models)."""
    return "qwen" if "qwen" in model_name.lower() else "llama"


def lora_learning_rate(hidden_size: int, family: str = "llama") -> float:
    if family not in FAMILY_EXPONENTS:
        raise ValueError(f"unknown model family {family!r}: use one of {sorted(FAMILY_EXPONENTS)}")
    if hidden_size <= 0:
        raise ValueError(f"hidden_size must be positive, got {hidden_size}")
    return BASE_FULL_FINETUNE_LR * LORA_LR_MULTIPLIER * (2000 / hidden_size) ** FAMILY_EXPONENTS[family]


def hidden_size_of(model_dir: str | Path) -> int:
    """``hidden_size`` from a local HF model directory's ``config.json``."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: pass a local Hugging Face model directory")
    config = json.loads(config_path.read_text())
    return int(config.get("hidden_size") or config["text_config"]["hidden_size"])
