"""Tiny randomly initialised models of each family Tinker users train, saved as local HF directories.

Each has the SmolLM2 tokenizer and its 49152-token vocabulary (so the engine's tokenizer, stop rules and
pad token are real), hidden size 64 and 2 layers: a model builds and loads in about a second.
"""

from __future__ import annotations

from pathlib import Path

import torch

from localtinker.engine.packaged import cached_model_dir, localtinker_home, smollm2_hf_dir

_VERSION = "v2"  # v2: Gemma 2's attention soft cap 1, Gemma 3 with a full layer
_COMMON = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096,
)


def _configs() -> dict[str, object]:
    from transformers import (
        Cohere2Config, DeepseekV3Config, FalconConfig, Gemma2Config, Gemma3TextConfig, GptOssConfig, GraniteConfig,
        LlamaConfig, MiniCPM3Config, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig,
        Starcoder2Config,
    )

    return {
        "llama": LlamaConfig(**_COMMON, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
                             tie_word_embeddings=True),
        "qwen2": Qwen2Config(**_COMMON, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=True),
        "mistral": MistralConfig(**_COMMON, head_dim=16, tie_word_embeddings=False),
        # soft caps low enough to bend these tiny models' scores and logits (Gemma 2's real ones, 50 and 30, would
        # not move them beyond float32 rounding); Gemma 3 with a sliding and a full layer, each rotated by its own
        # frequencies
        "gemma2": Gemma2Config(**_COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                               final_logit_softcapping=3.0, attn_logit_softcapping=1.0),
        "gemma3_text": Gemma3TextConfig(**_COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                        final_logit_softcapping=3.0,
                                        layer_types=["sliding_attention", "full_attention"]),
        "qwen3_moe": Qwen3MoeConfig(**_COMMON, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                    num_experts_per_tok=2, tie_word_embeddings=True),
        # attention sinks, biases everywhere, sliding windows on alternate layers, experts transposed with gate and
        # up interleaved and gated their own way
        "gpt_oss": GptOssConfig(**{**_COMMON, "intermediate_size": 96}, head_dim=16, num_local_experts=4,
                                num_experts_per_tok=2, sliding_window=8, tie_word_embeddings=False,
                                layer_types=["sliding_attention", "full_attention"]),
        # sliding windows on the Llama-shaped families: Mistral v0.1's on every layer (no layer types), Qwen2's
        # from use_sliding_window on the layers from max_window_layers on (here the second)
        "mistral_sliding": MistralConfig(**_COMMON, head_dim=16, sliding_window=8, tie_word_embeddings=False),
        "qwen2_sliding": Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                     tie_word_embeddings=True),
        # brought from the hub (BROUGHT_FAMILIES): Granite's µP multipliers, the logits divided by 4
        "granite": GraniteConfig(**_COMMON, logits_scaling=4.0, embedding_multiplier=3.0, residual_multiplier=0.5,
                                 attention_multiplier=0.2, tie_word_embeddings=True),
        # Command R7B: logits times 1/4, LayerNorm, a sliding and a full layer, parallel attention and MLP
        "cohere2": Cohere2Config(**_COMMON, head_dim=16, logit_scale=0.25, sliding_window=8,
                                 layer_types=["sliding_attention", "full_attention"]),
        # latent attention: queries, keys and values out of low-rank latents, values of another head size
        "minicpm3": MiniCPM3Config(**{**_COMMON, "num_key_value_heads": 4}, q_lora_rank=32, kv_lora_rank=16,
                                   qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, dim_model_base=32,
                                   scale_emb=2.0, tie_word_embeddings=False),
        # attention modules of its own (not transformers' attention interface), a fused qkv, GELU
        "falcon": FalconConfig(**{key: value for key, value in _COMMON.items()
                                  if key not in ("intermediate_size", "num_key_value_heads")},
                               new_decoder_architecture=True, num_kv_heads=2),
        # latent attention and routed experts (grouped top-k with a score-correction bias) behind a dense layer
        "deepseek_v3_moe": DeepseekV3Config(**{**_COMMON, "num_key_value_heads": 4}, q_lora_rank=32, kv_lora_rank=16,
                                            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                                            num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                                            n_group=1, topk_group=1, tie_word_embeddings=False),
        # fused qkv and gate/up projections (LoRA names of its own)
        "phi3": Phi3Config(**_COMMON, tie_word_embeddings=False),
        # an MLP of c_fc / c_proj (a name GPT-2's attention also has: lora.misadapted_projections), biases
        "starcoder2": Starcoder2Config(**_COMMON, tie_word_embeddings=True),
    }


FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "qwen3_moe", "gpt_oss")
SLIDING_FAMILIES: tuple[str, ...] = ("mistral_sliding", "qwen2_sliding")  # families above, with a window of 8
# Beyond the families Tinker hosts: each one a kind of difference the engine must handle (output_head.py,
# families.multi_latent_attention, attention.takes_engine_attention)
BROUGHT_FAMILIES: tuple[str, ...] = ("granite", "cohere2", "minicpm3", "deepseek_v3_moe", "falcon", "phi3",
                                     "starcoder2")
_JITTERED = ("norm", "sinks", "bias")  # parameters that start at exactly 1 or 0 (biases and sinks: gpt-oss's only)


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
                    if any(part in name for part in (_JITTERED if family == "gpt_oss" else _JITTERED[:1])):
                        param.add_(torch.randn_like(param) * 0.1)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        return family

    return cached_model_dir(localtinker_home() / "models" / f"test-family-{family}-{_VERSION}", build)


_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1's magnitudes; codes 8-15 are their negatives


def mxfp4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [experts, in, out] (transformers' gpt-oss layout) in the MXFP4 checkpoint schema: blocks uint8
    [experts, out, in / 32, 16] (two 4-bit codes a byte, the even element in the low nibble) and scales uint8
    [experts, out, in / 32] (each block's power of two, biased by 127), rounded to the nearest value."""
    rows = weight.transpose(1, 2).float()  # [E, out, in], as checkpoints store it
    blocks = rows.reshape(*rows.shape[:2], -1, 32)
    largest = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(largest / 6.0))  # the block's largest value at most 6 after scaling
    scaled = blocks / torch.exp2(exponent)
    magnitudes = torch.tensor(_FP4_VALUES)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1) + 8 * (scaled < 0)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent[..., 0] + 127).to(torch.uint8)


def mxfp4_family_dir() -> Path:
    """The tiny gpt-oss (``family_dir("gpt_oss")``) as its checkpoints come from the hub: experts in MXFP4
    (``*_blocks`` / ``*_scales`` tensors, ``quantization_config.quant_method = "mxfp4"``), the rest as it was."""

    def build(staging: Path) -> str:
        import json
        import shutil

        from safetensors.torch import load_file, save_file

        source = family_dir("gpt_oss")
        for path in source.iterdir():
            if path.suffix != ".safetensors":
                shutil.copy(path, staging / path.name)
        tensors = {}
        for shard in sorted(source.glob("*.safetensors")):
            for key, tensor in load_file(str(shard)).items():
                if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = mxfp4_blocks(tensor)
                else:
                    tensors[key] = tensor
        (staging / "model.safetensors.index.json").unlink(missing_ok=True)
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((staging / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        return "gpt_oss in mxfp4"

    return cached_model_dir(localtinker_home() / "models" / f"test-family-gpt_oss-mxfp4-{_VERSION}", build)
