"""What the engine reads from a model's config: architecture, context length, the final-logit soft cap, and
whether the CPU path's own attention (shared-prompt decode, shared-prefix training) covers the model.

Gemma 2 and 3 cap their logits (``cap·tanh(logits / cap)``) inside ``ForCausalLM.forward``, which the engine
bypasses (it unembeds only the positions it needs), so the cap is applied by the engine's own head functions.
Sliding-window layers, attention-logit soft caps and multi-head latent attention are beyond the CPU path's
attention kernels: such models run the portable path (the CUDA path's code) on the CPU too.

gpt-oss's checkpoints keep the experts in MXFP4 (4-bit values, a shared exponent per 32). transformers would keep
them so where Triton and the ``kernels`` package are installed (replacing the experts with modules no LoRA
reaches, and fetching kernels from the hub), and dequantize them elsewhere: :func:`load_options` always asks for
the dequantized weights, so a base model trains the same on every machine.
"""

from __future__ import annotations

from typing import Any


def text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def architecture(config: Any) -> str:
    """The model family as transformers names it (``llama``, ``qwen3``, ``gemma3_text``, ``qwen3_moe``, ...)."""
    return str(getattr(text_config(config), "model_type", None) or getattr(config, "model_type", "unknown"))


def context_length(config: Any, default: int = 2048) -> int:
    return int(getattr(text_config(config), "max_position_embeddings", None) or default)


def final_softcap(config: Any) -> float | None:
    cap = getattr(text_config(config), "final_logit_softcapping", None)
    return float(cap) if cap else None


def attention_softcap(config: Any) -> float | None:
    """Gemma 2's soft cap on the attention scores (``cap·tanh(s / cap)``), or None."""
    cap = getattr(text_config(config), "attn_logit_softcapping", None)
    return float(cap) if cap else None


def uses_sliding_windows(config: Any) -> bool:
    text = text_config(config)
    window = getattr(text, "sliding_window", None)
    if not window or window >= context_length(text):
        return False
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        return "sliding_attention" in layer_types
    return bool(getattr(text, "use_sliding_window", True))


def layer_windows(config: Any) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention), as transformers' own masks apply them: by
    ``layer_types`` where the config has them (gpt-oss, Qwen2/3 with ``use_sliding_window``), on every layer where
    it has a window and no layer types (Mistral v0.1's 4096). A window no position reaches counts as none. Raises
    ValueError on a layer type other than full or sliding attention (Llama 4's chunked layers), which no window
    describes."""
    text = text_config(config)
    layers = int(text.num_hidden_layers)
    types = getattr(text, "layer_types", None)
    unknown = sorted(set(types or ()) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"layer types {unknown} are neither full nor sliding-window attention")
    if not uses_sliding_windows(config):
        return [None] * layers
    window = int(text.sliding_window)
    if types is None:
        return [window] * layers
    return [window if kind == "sliding_attention" else None for kind in types]


def multi_latent_attention(config: Any) -> bool:
    """Whether the model's attention is multi-head latent attention (DeepSeek-V2/V3, Kimi K2, MiniCPM3): keys and
    values come out of a low-rank latent, and the values' head size differs from the queries' and keys'."""
    return getattr(text_config(config), "kv_lora_rank", None) is not None


ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
STATELESS_LAYER_TYPES = frozenset({"moe", "mlp"})  # Nemotron-H's MLP-only blocks


def recurrent_layer_types(config: Any) -> list[str]:
    """The config's layer types that carry a recurrent state instead of keys and values (Mamba, linear
    attention, short convolutions, the hybrids' both: Falcon-H1, Granite 4, Qwen3-Next, Jamba, Nemotron-H), in
    order of first appearance; empty for a transformer."""
    text = text_config(config)
    types = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None) or ()
    return list(dict.fromkeys(kind for kind in types if kind not in ATTENTION_LAYER_TYPES | STATELESS_LAYER_TYPES))


def cpu_kernels_cover(config: Any) -> bool:
    """Whether the CPU path's tuned attention and head serve this model (no soft caps, no sliding windows, no
    latent attention)."""
    return not (final_softcap(config) or attention_softcap(config) or uses_sliding_windows(config)
                or multi_latent_attention(config))


def load_options(config: Any) -> dict[str, Any]:
    """Extra ``from_pretrained`` options for a base model that is trained: MXFP4 experts dequantized (see above)."""
    quantization = getattr(config, "quantization_config", None)
    if isinstance(quantization, dict):
        method = quantization.get("quant_method")
    else:
        method = getattr(quantization, "quant_method", None)
    if str(getattr(method, "value", method)) == "mxfp4":
        from transformers import Mxfp4Config

        return {"quantization_config": Mxfp4Config(dequantize=True)}
    return {}
