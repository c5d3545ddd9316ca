"""Base-model registry: turns a Tinker ``base_model`` name into a loaded, frozen causal LM.

Names resolve in this order:
- ``HuggingFaceTB/SmolLM2-135M-Instruct``: the packaged weights (:func:`packaged.smollm2_hf_dir`), no network;
- ``localtinker/tiny-random``: a small randomly initialised Llama with the SmolLM2 tokenizer, built once
  with a fixed seed and cached, so tests run in seconds yet use a real tokenizer;
- an existing local directory holding an HF model;
- anything else is treated as a hub id (ordinary ``from_pretrained``; offline it fails with a clear message).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from localtinker.engine.api import EngineUserError, UnknownModelError
from localtinker.engine.bf16_head import Bf16Head
from localtinker.engine.bf16_matmul import bf16_matmul_is_fast
from localtinker.engine.attention import takes_engine_attention, use_engine_attention
from localtinker.engine.families import (
    architecture, context_length, cpu_kernels_cover, load_options, recurrent_layer_types,
)
from localtinker.engine.hub_cache import register_tokenizer
from localtinker.engine.model_memory import check_weights_fit
from localtinker.engine.output_head import check_output_head, fold_logit_multiplier
from localtinker.engine.packaged import SMOLLM2_NAME, cached_model_dir, localtinker_home, smollm2_hf_dir

TINY_RANDOM_NAME = "localtinker/tiny-random"
_TINY_RANDOM_VERSION = "v1"
_TINY_RANDOM_SEED = 1234

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class BaseModel:
    """A frozen base model plus what the engine needs to know about it."""

    name: str
    model: torch.nn.Module  # a *ForCausalLM, parameters frozen, in eval mode
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    tokenizer_id: str  # a local directory (or hub id) AutoTokenizer loads
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_context_length: int
    arch: str
    portable: bool = False  # computes through the portable path (the CUDA path's code), not the tuned CPU one


def tiny_random_dir() -> Path:
    """Builds (once) and returns the cached directory of ``localtinker/tiny-random``.

    Hidden 64, 2 layers, 4 heads (2 KV heads), SmolLM2's 49152-token vocabulary and tokenizer files, so
    ``tokenizer_id`` is a real local directory. Deterministic: the same seed gives the same weights.
    """
    target = localtinker_home() / "models" / f"tiny-random-{_TINY_RANDOM_VERSION}"
    return cached_model_dir(target, _build_tiny_random)


def _build_tiny_random(staging: Path) -> str:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer_dir = smollm2_hf_dir()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(_TINY_RANDOM_SEED)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.config._name_or_path = TINY_RANDOM_NAME
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    return f"seed {_TINY_RANDOM_SEED}"


def resolve_model_dir(name: str) -> str:
    """Maps a base-model name to what ``from_pretrained`` should load (local dir or hub id)."""
    if name == SMOLLM2_NAME:
        return str(smollm2_hf_dir())
    if name == TINY_RANDOM_NAME:
        return str(tiny_random_dir())
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser().resolve())
    return name


def load_base_model(name: str, dtype: str, device: torch.device | None = None, portable: bool | None = None) -> BaseModel:
    """Loads ``name`` frozen, in ``dtype``, on ``device`` (default CPU); raises :class:`UnknownModelError` when it
    cannot be found, and :class:`EngineUserError` when the engine's head would not compute its own logits
    (output_head.py). ``portable`` None: the portable path off the CPU, and on the CPU for models whose
    attention the tuned CPU kernels do not cover (families.py, or modules that bypass transformers' attention
    interface); True forces it (tests run the CUDA path's code on the CPU that way)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise EngineUserError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}.")
    device = torch.device("cpu") if device is None else device
    source = resolve_model_dir(name)
    try:
        config = AutoConfig.from_pretrained(source)
        refuse_recurrent_layers(name, config)
        tokenizer = AutoTokenizer.from_pretrained(source)
        placement = {"device_map": str(device)} if device.type != "cpu" else {}
        check_weights_fit(name, config, DTYPES[dtype], device)  # before reading any weight (model_memory.py)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[dtype], **placement, **load_options(config))
    except OSError as error:
        raise UnknownModelError(
            f"base model {name!r} could not be loaded ({error.__class__.__name__}: {error}). Use "
            f"{SMOLLM2_NAME!r}, {TINY_RANDOM_NAME!r}, a local HF model directory, or a hub id on a machine "
            "with network access."
        ) from error
    fold_logit_multiplier(model)
    check_output_head(name, model)
    if portable is None:
        portable = device.type != "cpu" or not cpu_kernels_cover(config) or not takes_engine_attention(model)
    if source != name:
        register_tokenizer(name, Path(source))
    if portable:
        return portable_base_model(name, model, tokenizer, source, device)
    if DTYPES[dtype] != torch.float32:
        if not bf16_matmul_is_fast():
            _use_float32_master_head(model, Float32Head)
            _compute_linears_in_float32(model)
        else:
            _use_float32_master_head(model, Bf16Head)
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        use_engine_attention(model)  # bf16 products with a float32 softmax; the sampler's shared prompts in all
    return _frozen(name, model, tokenizer, source)


def refuse_recurrent_layers(name: str, config: object) -> None:
    """Refuses, before any weight is read, a model with layers that keep a recurrent state (state-space or
    linear-attention layers, families.recurrent_layer_types): localtinker packs several sequences into one row to
    train and samples over a cache of keys and values, and neither keeps such a state apart per sequence."""
    kinds = recurrent_layer_types(config)
    if kinds:
        raise EngineUserError(
            f"base model {name!r} ({architecture(config)}) has layers of type {', '.join(kinds)}: state-space or "
            "linear-attention layers, which carry a recurrent state. localtinker trains packed sequences and samples "
            "over a key/value cache, and runs transformer models only (every layer full or sliding-window "
            "attention); nothing was loaded. Use a transformer model, or hosted Tinker for this one.")


def _frozen(name: str, model: torch.nn.Module, tokenizer: object | None, tokenizer_id: str, *, portable: bool = False) -> BaseModel:
    """``model`` frozen for serving, with what the protocol reports of it read from its config."""
    model.eval()
    model.requires_grad_(False)
    config = model.config
    return BaseModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        tokenizer_id=tokenizer_id,
        vocab_size=int(getattr(config.get_text_config(), "vocab_size", None) or config.vocab_size),
        eos_token_ids=_eos_token_ids(config, tokenizer),
        max_context_length=context_length(config),
        arch=architecture(config),
        portable=portable,
    )


def portable_base_model(name: str, model: torch.nn.Module, tokenizer: object | None, tokenizer_id: str,
                        device: torch.device) -> BaseModel:
    """``model`` frozen on ``device`` in its own dtype (bf16 weights stay bf16: no float32 copy of any base
    weight), attending through the portable path's attention (portable_attention.py)."""
    from localtinker.engine.portable_attention import use_portable_attention

    model.to(device)
    use_portable_attention(model)
    return _frozen(name, model, tokenizer, tokenizer_id, portable=True)


class Float32ComputeLinear(torch.nn.Linear):
    """A frozen linear layer whose weights stay in bf16 at rest but multiply in float32.

    Used for ``dtype="bfloat16"`` where bf16 matmuls are not faster (bf16_matmul.py): half the weight memory of float32,
    float32 speed and accuracy (activations flow in float32), and peft still sees an ``nn.Linear``.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return torch.nn.functional.linear(hidden.float(), self.weight.float(), bias)


def _compute_linears_in_float32(model: torch.nn.Module) -> None:
    for module in model.get_decoder().modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = Float32ComputeLinear


class Float32Head(torch.nn.Linear):
    """The unembedding computed in float32 from (already rounded) low-precision hidden states, where
    bf16 matmuls are not faster (with fast ones: bf16_head.py).

    bf16 logits are quantised to ~0.06 at typical magnitudes, which alone would make sampler and trainer
    logprobs disagree by tenths; a float32 head costs one extra vocab × hidden copy. Still an ``nn.Linear``, so peft can put LoRA on it.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden.to(self.weight.dtype), self.weight, self.bias)


def _use_float32_master_head(model: torch.nn.Module, head_class: type[torch.nn.Linear]) -> None:
    """Replaces ``model``'s unembedding by a ``head_class`` (Float32Head, or bf16_head.Bf16Head) holding a float32
    copy of its weights, untied from the embeddings."""
    head = model.get_output_embeddings()
    if head is None or type(head) is not torch.nn.Linear:
        return
    new_head = head_class(head.in_features, head.out_features, bias=head.bias is not None, device="meta")
    new_head.weight = torch.nn.Parameter(head.weight.detach().float().clone(), requires_grad=False)
    if head.bias is not None:
        new_head.bias = torch.nn.Parameter(head.bias.detach().float().clone(), requires_grad=False)
    if isinstance(new_head, Bf16Head):
        new_head.prepare()  # its bf16 (packed) copies of the master weight
    model.set_output_embeddings(new_head)
    model.config.tie_word_embeddings = False  # the head is now a separate float32 copy


def _eos_token_ids(config: object, tokenizer: object) -> tuple[int, ...]:
    configured = getattr(config, "eos_token_id", None)
    ids = list(configured) if isinstance(configured, list) else [configured]
    ids.append(getattr(tokenizer, "eos_token_id", None))
    return tuple(sorted({int(i) for i in ids if i is not None}))
