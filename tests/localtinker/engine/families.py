"""Tiny randomly initialised models of each family Tinker users train, saved as local HF directories.

Each has the SmolLM2 tokenizer and its 49152-token vocabulary (so the engine's tokenizer, stop rules and
pad token are real), hidden size 64 and 2 layers: a model builds and loads in about a second.
"""

from __future__ import annotations

from pathlib import Path

import torch

from localtinker.engine.packaged import cached_model_dir, localtinker_home, smollm2_hf_dir

_VERSION = "v1"
_COMMON = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096,
)


def _configs() -> dict[str, object]:
    from transformers import (
        Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig,
    )

    return {
        "llama": LlamaConfig(**_COMMON, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
                             tie_word_embeddings=True),
        "qwen2": Qwen2Config(**_COMMON, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=True),
        "mistral": MistralConfig(**_COMMON, head_dim=16, tie_word_embeddings=False),
        "gemma2": Gemma2Config(**_COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                               final_logit_softcapping=3.0, attn_logit_softcapping=50.0),
        "gemma3_text": Gemma3TextConfig(**_COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                        final_logit_softcapping=3.0),
        "qwen3_moe": Qwen3MoeConfig(**_COMMON, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                    num_experts_per_tok=2, tie_word_embeddings=True),
    }


FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "qwen3_moe")


def family_dir(family: str) -> Path:
    """The cached directory of ``family``'s tiny random model (built once, seed 0)."""

    def build(staging: Path) -> str:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir())
        config = _configs()[family]
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(config, key, getattr(tokenizer, key))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            with torch.no_grad():  # norms start at exactly 1 (or 0): jitter them so a dropped scale shows
                for name, param in model.named_parameters():
                    if "norm" in name:
                        param.add_(torch.randn_like(param) * 0.1)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        return family

    return cached_model_dir(localtinker_home() / "models" / f"test-family-{family}-{_VERSION}", build)
