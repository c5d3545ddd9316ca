"""A merged Llama-family model as one GGUF file (float32 tensors, llama.cpp's names and metadata).

llama.cpp stores the q and k projections with each head's rotary halves interleaved (its converter's
``permute``); transformers' GGUF loader undoes that, so loading the file back with
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` gives the merged model's weights exactly.
The tokenizer (BPE vocabulary, merges, special ids, chat template) is written from ``tokenizer.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from posttrain.export.adapter import ExportError

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(name: str) -> str | None:
    name = name.removesuffix(".weight")
    if name == "model.embed_tokens":
        return "token_embd.weight"
    if name == "model.norm":
        return "output_norm.weight"
    if name == "lm_head":
        return "output.weight"
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        layer = _LAYER_NAMES.get(".".join(parts[3:]))
        if layer:
            return f"blk.{parts[2]}.{layer}.weight"
    return None


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(model_dir: Path, target: Path) -> None:
    import gguf

    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ExportError(f"GGUF export supports Llama-family models; {model_dir} is {config.get('model_type')!r}")
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    writer = gguf.GGUFWriter(str(target), "llama")
    writer.add_name(config.get("_name_or_path") or model_dir.name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(_rope_theta(config, model_dir))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(writer, model_dir, config)
    with safe_open(str(model_dir / "model.safetensors"), framework="np") as tensors:
        for name in tensors.keys():
            gguf_name = _gguf_name(name)
            if gguf_name is None:
                raise ExportError(f"{model_dir}: no GGUF name for tensor {name!r}")
            weight = tensors.get_tensor(name).astype(np.float32)
            if gguf_name.endswith("attn_q.weight"):
                weight = _permute(weight, heads)
            elif gguf_name.endswith("attn_k.weight"):
                weight = _permute(weight, kv_heads)
            writer.add_tensor(gguf_name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _rope_theta(config: dict, model_dir: Path) -> float:
    """The rotary base: transformers 5 keeps it in ``rope_parameters`` (older configs at the top level); only
    unscaled rotary embeddings have a GGUF form here, so a scaled one is refused rather than written wrong."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default":
        raise ExportError(f"GGUF export writes unscaled rotary embeddings; {model_dir} uses rope_type {kind!r}")
    return float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0)


def _add_tokenizer(writer, model_dir: Path, config: dict) -> None:
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    if tokenizer["model"]["type"] != "BPE":
        raise ExportError(f"GGUF export writes BPE tokenizers; {model_dir}'s is {tokenizer['model']['type']}")
    vocab = dict(tokenizer["model"]["vocab"])
    special = {t["id"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
    for added in tokenizer.get("added_tokens", []):
        vocab.setdefault(added["content"], added["id"])
    by_id = {i: t for t, i in vocab.items()}
    size = config["vocab_size"]
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    types = [3 if i in special else 1 for i in range(size)]  # 3 = control, 1 = normal (llama.cpp's token types)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("pad_token", writer.add_pad_token_id), ("unk_token", writer.add_unk_token_id)):
        token = tokenizer_config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if token in vocab:
            add(vocab[token])
    template = tokenizer_config.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)
