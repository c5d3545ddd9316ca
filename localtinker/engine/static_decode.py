"""The portable sampler's decode step over a preallocated KV cache, replayed as a CUDA graph on a GPU.

A decode step through transformers' layers is well over a thousand kernel launches for a 1B model; on a
GPU the host cannot issue them as fast as the card runs them (docs/localtinker-gpu.md). This step is
written out for the Llama-shaped families (Llama, Qwen2, Qwen3, Mistral; Qwen3-MoE and gpt-oss with their MoE
blocks run as modules inside the step; Gemma 2 and 3 with their four norms, GELU and soft caps; sliding windows,
on the layers the config names, as one more mask, and gpt-oss's attention sinks as one more softmax column) over
buffers that never move, so the whole step is captured once per (rows, columns) bucket and replayed with one
launch.

Layout: ``keys[layer]`` / ``values[layer]`` are ``[slots, kv heads, columns, head dim]``; a row's token at
position *p* sits in column *p* (right-padded, unlike ``kv_rows``'s left padding), so a row attends to the
columns ``≤ its position`` and needs no mask tensor from the host. Rows live in slots ``0..n-1``; a finished
row's slot is filled by compaction. Inputs (``tokens``, ``positions``) are written in place before each
replay. The LoRA factors of the sampler's adapter are copied into buffers of the decoder's own, so one
set of graphs serves every adapter of the same layout (an RL loop samples a new snapshot every step).
Each layer runs decode_layer.py's pieces (compiled on a GPU with Triton): q/k/v, and gate/up, are one
product each over weights the modules share (:class:`_SharedInput`). A step can also choose its tokens
inside the graph (:meth:`StaticDecoder.step_and_choose`), so the host need not wait for it before queuing
the next one. Prompts are prefilled through the same pieces, op by op, each once and packed without padding
(:meth:`StaticDecoder.prefill`).

Attention groups a KV head's query heads as a short query sequence (``[rows, kv heads, group, dim]``)
against that head's cache, so no key is repeated per query head, and is written as two products with a
float32 softmax between (transformers' eager formula): for bf16 on a Hopper card sdpa picks its cuDNN
backend, whose capture fails and leaves the CUDA generator unusable (docs/localtinker-gpu.md). The same
code runs eagerly on a CPU, where the tests check it against transformers' forward.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from localtinker.engine.decode_layer import (
    SANDWICH_FAMILIES, LayerShape, Projection, attention_residual, compile_by_default, compiled_once, layer_rotations,
    norm_weight, pieces, post_attention, pre_attention, project, rms, rotation, sandwich_post_attention,
)
from localtinker.engine.expert_lora import adapters_of, grouped_possible, unsupported
from localtinker.engine.families import architecture, attention_softcap, final_softcap, layer_windows, text_config
from localtinker.engine.model_memory import total_bytes
from localtinker.engine.packed_layout import PackedLayout, segment_visibility
from localtinker.engine.portable_attention import explicit_attention, packed_causal_attention
from localtinker.engine.token_choice import choose_in_step

STATIC_DECODE_FAMILIES = frozenset({"llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "gpt_oss", *SANDWICH_FAMILIES})
MIN_COLUMNS = 128  # a graph is captured per power-of-two bucket of rows and of attended columns
SLOT_FLOOR = 8  # the fewest slots a cache is made with
_POOL = "_localtinker_static_decoders"  # on the base model: decoders whose batch has drained, graphs kept
_KEPT_DECODERS = 2
_KEPT_CACHE_SHARE = 1 / 8  # of the device's memory: the pooled decoders' caches together, at most
ATTENTION_ENV = "LOCALTINKER_DECODE_ATTENTION"  # "sdpa": one fused kernel per layer (opt-in until measured)
JOINED_ENV = "LOCALTINKER_DECODE_JOINED"  # "1"/"0": joined weights always/never (default: see joined_by_default)
_JOINED_SHARE = 1 / 16  # of the device's memory: one decoder's joined weights, at most
logger = logging.getLogger("localtinker.engine")
# Rows of StaticDecoder.controls, per slot: the row's next uniform draw, its temperature (1 for greedy and free
# slots), 1 for greedy, 1 for a live row (a free slot in the bucket's width must not move its position on).
CONTROLS = ("uniform", "temperature", "greedy", "live")


def pooled_decoders(model: torch.nn.Module) -> list[StaticDecoder]:
    """The decoders kept on ``model`` between batches."""
    return model.__dict__.setdefault(_POOL, [])


def static_decode_supported(model: torch.nn.Module, moe: bool = True) -> bool:
    """Whether :class:`StaticDecoder` computes this model's own decode step: a Llama-shaped family (or Gemma 2/3)
    whose MLPs are plain linears, or (``moe``) a mixture-of-experts block over fused experts that expert_lora.py
    adapts, which then runs as its own module inside the step (router, experts and their LoRA alike)."""
    config = model.config
    text = text_config(config)
    family = architecture(config)
    gate = "gelu_pytorch_tanh" if family in SANDWICH_FAMILIES else "silu"
    activation = getattr(text, "hidden_activation", None) or getattr(text, "hidden_act", "silu")
    if family not in STATIC_DECODE_FAMILIES or activation != gate:
        return False
    try:
        layer_windows(config)  # sliding windows are masked per layer; other layer types are not written out
    except ValueError:
        return False
    groups = [[model.get_output_embeddings()]]
    for layer in model.get_decoder().layers:
        attention = layer.self_attn
        groups += [[attention.q_proj, attention.k_proj, attention.v_proj], [attention.o_proj]]
        if moe_block(layer) is not None:
            if not moe:
                return False
        elif any(p.dim() == 3 for p in layer.parameters()):
            return False
        else:
            groups += [[layer.mlp.gate_proj, layer.mlp.up_proj], [layer.mlp.down_proj]]
    return all(_plain([frozen_layer(module) for module in group]) for group in groups)


def moe_block(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The layer's mixture-of-experts block where its experts are fused ones expert_lora.py adapts, else None."""
    experts = getattr(layer.mlp, "experts", None)
    return layer.mlp if isinstance(experts, torch.nn.Module) and unsupported(experts) is None else None


def run_moe_block(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An MoE block (router, experts, their LoRA: expert_lora.py) on rows ``x`` [tokens, hidden], as the model's
    layer runs it (on [batch, sequence, hidden]). Nothing in it waits for the host where the experts' products
    run as grouped GEMMs, so a CUDA graph captures it; where they cannot (``expert_lora.grouped_possible``), the
    decoder decodes without graphs from the start (``graph_error`` says why)."""
    out = block(x[None])
    return (out[0] if isinstance(out, tuple) else out)[0]


def _prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float,
                      window: int | None, sinks: torch.Tensor | None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of prompts packed end to end (q [tokens, heads, d], k and v [tokens, kv heads, d]) with
    ``sinks`` ([kv heads, group, 1]) and/or a soft cap on the scores (Gemma 2), and a sliding ``window``, prompt by
    prompt through the explicit product (portable_attention.py): a prefill is not captured, and its prompts'
    [n × n] scores are small. Returns [tokens, heads, d]."""
    outputs, start = [], 0
    for n in lengths:
        queries, keys, values = (t[start : start + n].transpose(0, 1)[None] for t in (q, k, v))
        visible = segment_visibility(n, n, window, q.device)
        outputs.append(explicit_attention(queries, keys, values, visible[None, None], scale, softcap,
                                          None if sinks is None else sinks.reshape(-1))[0])
        start += n
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


def bucket(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def frozen_layer(module: torch.nn.Module) -> torch.nn.Module:
    """The frozen layer under peft's LoRA wrapper (or the layer itself)."""
    return getattr(module, "base_layer", module)


def _factors(module: torch.nn.Module, adapter: str | None) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """``adapter``'s (A, B, s) on ``module`` (lora.py's fused forward applies A, then s·B); None where it does
    not adapt the module."""
    lora_a = getattr(module, "lora_A", None)
    if adapter is None or lora_a is None or adapter not in lora_a:
        return None
    return lora_a[adapter].weight, module.lora_B[adapter].weight, float(module.scaling[adapter])


class _Loads:
    """The copies an adapter's load makes into a decoder's buffers, made together: a 16-layer model's adapter is
    224 factors, and copying (and scaling) them one by one was ~340 launches and their Python at every RL step's
    new snapshot. Here: the scaled B factors in one multi-tensor product (in their own dtype, as lora.py scales
    them, before rounding to the buffers'), then one multi-tensor copy, then one multi-tensor zeroing."""

    def __init__(self) -> None:
        self.targets: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []
        self.scaled: list[tuple[torch.Tensor, torch.Tensor, float]] = []  # (target, B, s): target = (s·B)ᵀ
        self.zeroed: list[torch.Tensor] = []

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        self.targets.append(target)
        self.sources.append(source)

    def copy_scaled_t(self, target: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        self.scaled.append((target, b, scale))

    def run(self) -> None:
        if self.scaled:
            targets, factors, scales = zip(*self.scaled)
            for target, product in zip(targets, torch._foreach_mul(list(factors), list(scales))):
                self.copy(target, product.t())
        if self.targets:
            torch._foreach_copy_(self.targets, self.sources)
        if self.zeroed:
            torch._foreach_zero_(self.zeroed)


class _Projection:
    """One linear of the step: its frozen base layer and, for an adapted layer, the adapter's factors
    rounded to the compute dtype in buffers of fixed address."""

    def __init__(self, module: torch.nn.Module, joined: bool = False) -> None:
        self.module, self.base = module, frozen_layer(module)
        self.joined = _Joined() if joined else None
        self.a: torch.Tensor | None = None
        self.b_t: torch.Tensor | None = None

    def load(self, adapter: str | None, compute: torch.dtype, loads: _Loads) -> bool:
        """Adds the copies of ``adapter``'s factors into this layer's buffers to ``loads`` (zeros for a layer
        it does not adapt); True when the buffers were (re)allocated, which invalidates captured graphs."""
        factors = _factors(self.module, adapter)
        if factors is None:
            if self.a is not None:
                loads.zeroed += [self.a, self.b_t]
            return False
        a, b, scale = factors
        fresh = self.a is None or self.a.shape != a.shape or self.a.dtype != compute
        if fresh:
            self.a = _a_buffer(self.joined, self.base.weight, self.base.bias, a.shape, compute)
            self.b_t = torch.empty((b.shape[1], b.shape[0]), dtype=compute, device=a.device)
        loads.copy(self.a, a)
        loads.copy_scaled_t(self.b_t, b, scale)
        return fresh

    def parts(self) -> Projection:
        if self.joined is not None and self.joined.weight is not None:
            return self.joined.weight, self.joined.bias, None, self.b_t
        return self.base.weight, self.base.bias, self.a, self.b_t


@dataclass
class _Joined:
    """A decoder's own copy of a group's base weight with the adapter's A rows after it (``[W; A]``, and the
    bias with zeros for those rows), so ``x Aᵀ`` comes out of the base product: a decode step of a small
    model is bound by its number of kernels, and this saves one product per group and layer (64 per step of a
    16-layer model, ~20 µs of ~150 per layer in an H200 profile; docs/localtinker-gpu.md). Each decoder has
    its own copy because decoders of different adapters step at once over the same base model."""

    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None


def _a_buffer(joined: _Joined | None, weight: torch.Tensor, bias: torch.Tensor | None, shape: torch.Size | tuple,
              compute: torch.dtype) -> torch.Tensor:
    """A buffer for the stacked A factors (``shape``): rows of ``joined``'s fresh ``[W; A]`` where the group
    joins them (the base rows copied in once), else a tensor of its own."""
    if joined is None:
        return torch.empty(shape, dtype=compute, device=weight.device)
    rows = weight.shape[0]
    joined.weight = torch.empty((rows + shape[0], weight.shape[1]), dtype=compute, device=weight.device)
    joined.weight[:rows] = weight
    joined.bias = None if bias is None else torch.cat([bias.to(compute), bias.new_zeros(shape[0], dtype=compute)])
    return joined.weight[rows:]


class _SharedInput:
    """Projections that read the same input (q/k/v; gate/up) as one product.

    Their base weights are re-pointed, once per model, into one concatenated tensor: each module's weight
    becomes a view of its rows, so no memory is added and the trainer reads the very same values. The
    adapter's factors run as one product of the input with every A stacked, then one product with the
    B factors laid out block-diagonally, added into the concatenated output; each projection takes its
    columns. A decode step is bound by its number of kernels (docs/localtinker-gpu.md): q/k/v go from seven
    products to three.
    """

    def __init__(self, modules: list[torch.nn.Module], joined: bool = False) -> None:
        self.modules = modules
        bases = [frozen_layer(module) for module in modules]
        self.sizes = [base.weight.shape[0] for base in bases]
        self.weight, self.bias = shared_weights(bases)
        self.joined = _Joined() if joined else None
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None

    def load(self, adapter: str | None, compute: torch.dtype, loads: _Loads) -> bool:
        """As :meth:`_Projection.load`, for the stacked A and block-diagonal B."""
        factors = [_factors(module, adapter) for module in self.modules]
        if all(f is None for f in factors):
            if self.a is not None:
                loads.zeroed += [self.a, self.b]
            return False
        ranks = [0 if f is None else f[0].shape[0] for f in factors]
        fresh = self.a is None or self.a.shape[0] != sum(ranks) or self.a.dtype != compute
        if fresh:
            inputs, device = next(f[0].shape[1] for f in factors if f), next(f[0].device for f in factors if f)
            self.a = _a_buffer(self.joined, self.weight, self.bias, (sum(ranks), inputs), compute)
            self.b = torch.zeros((sum(ranks), sum(self.sizes)), dtype=compute, device=device)
        row = column = 0
        for f, rank, size in zip(factors, ranks, self.sizes):
            if rank:
                loads.copy(self.a[row : row + rank], f[0])
                loads.copy_scaled_t(self.b[row : row + rank, column : column + size], f[1], f[2])
            row, column = row + rank, column + size
        return fresh

    def parts(self) -> Projection:
        if self.joined is not None and self.joined.weight is not None:
            return self.joined.weight, self.joined.bias, None, self.b
        return self.weight, self.bias, self.a, self.b


def _attention_projections(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """q, k, v and o of a decoder layer."""
    return [getattr(layer.self_attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]


def _mlp_projections(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """gate, up and down of a decoder layer."""
    return [getattr(layer.mlp, name) for name in ("gate_proj", "up_proj", "down_proj")]


@contextmanager
def _sdpa_backend(efficient: bool) -> Iterator[None]:
    """sdpa restricted to its memory-efficient kernel where asked (a CUDA decode step with
    ``LOCALTINKER_DECODE_ATTENTION=sdpa``): on a Hopper card sdpa otherwise picks cuDNN, whose capture failed."""
    if not efficient:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        yield


def joined_by_default(device: torch.device, weight_bytes: int) -> bool:
    """Whether a decoder joins its adapter's A factors to copies of the base weights (:class:`_Joined`):
    ``LOCALTINKER_DECODE_JOINED=1``/``0`` decides; by default on CUDA where the copies (``weight_bytes``) take at
    most 1/16 of the card and a quarter of its free memory — a small model, whose decode step is bound by its
    kernels. A large one is bound by its weights' bytes, where a kernel more or less matters little."""
    setting = os.environ.get(JOINED_ENV)
    if setting in ("0", "1"):
        return setting == "1"
    if device.type != "cuda":
        return False
    free, total = torch.cuda.mem_get_info(device)
    return weight_bytes <= min(_JOINED_SHARE * total, free / 4)


_CONCATENATED = "_localtinker_concatenated"  # on the first base layer: (weight, bias) its group's views share


def _plain(bases: list[torch.nn.Module]) -> bool:
    """Whether ``bases`` are plain ``Linear`` layers of one layout (one input size, dtype, device; biases on
    all or none), which :func:`shared_weights` can hold."""
    if not all(type(base) is torch.nn.Linear for base in bases):
        return False
    first = bases[0].weight
    return (all(b.weight.dtype == first.dtype and b.weight.device == first.device
                and b.weight.shape[1] == first.shape[1] for b in bases)
            and len({b.bias is None for b in bases}) == 1)


def shared_weights(bases: list[torch.nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One tensor holding ``bases``' weights (and biases) row after row, each base's own parameter then a
    view of its rows (a single base: its own weight and bias)."""
    if len(bases) == 1:
        return bases[0].weight, bases[0].bias
    weights = [base.weight for base in bases]
    biases = [base.bias for base in bases]
    kept = bases[0].__dict__.get(_CONCATENATED)
    if kept is not None and _views_of(kept[0], weights) and (kept[1] is None or _views_of(kept[1], biases)):
        return kept
    with torch.inference_mode(False), torch.no_grad():  # the trainer's parameters: never inference tensors
        weight = torch.cat([w.detach() for w in weights])
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        for parameters, whole in ((weights, weight), (biases, bias)):
            if whole is not None:
                for parameter, rows in zip(parameters, whole.split([w.shape[0] for w in weights])):
                    parameter.data = rows
    bases[0].__dict__[_CONCATENATED] = (weight, bias)
    return weight, bias


def _views_of(whole: torch.Tensor, parts: list[torch.Tensor]) -> bool:
    """Whether ``parts`` are still ``whole``'s consecutive rows (nothing replaced a weight since)."""
    offset = 0
    for part in parts:
        if part.data_ptr() != whole.data_ptr() + offset * whole.element_size() or not part.is_contiguous():
            return False
        offset += part.numel()
    return offset == whole.numel()


class StaticDecoder:
    """Decode steps of one base model over its own KV buffers (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, compiled: bool | None = None, joined: bool | None = None) -> None:
        """``compiled``: the layer pieces through ``torch.compile`` (decode_layer.py); None = on CUDA with
        Triton, unless ``LOCALTINKER_DECODE_COMPILE=0``. ``joined``: the adapter's A factors joined to copies of
        the base weights (:class:`_Joined`); None = :func:`joined_by_default`."""
        self.model = model
        decoder = model.get_decoder()
        self.embed, self.norm, self.rotary = decoder.embed_tokens, decoder.norm, decoder.rotary_emb
        self.layers = list(decoder.layers)
        self.head = _Projection(model.get_output_embeddings())
        self.shape = LayerShape.of(model)
        self.device, self.dtype = self.embed.weight.device, self.embed.weight.dtype
        # each layer's MoE block (run as its module), or None where its MLP is plain linears (run as pieces)
        self.moe = [moe_block(layer) for layer in self.layers]
        layer_weights = sum(frozen_layer(module).weight.nbytes for layer, moe in zip(self.layers, self.moe)
                            for module in (*_attention_projections(layer), *([] if moe else _mlp_projections(layer))))
        self.joined = joined_by_default(self.device, layer_weights) if joined is None else joined
        self.projections = [
            {"qkv": _SharedInput(_attention_projections(layer)[:3], self.joined),
             "o_proj": _Projection(layer.self_attn.o_proj, self.joined),
             **({} if moe else {"gate_up": _SharedInput(_mlp_projections(layer)[:2], self.joined),
                                "down_proj": _Projection(layer.mlp.down_proj, self.joined)})}
            for layer, moe in zip(self.layers, self.moe)
        ]
        self._experts_key: tuple | None = None  # the expert factors the captured graphs read (see set_adapter)
        self.slots = self.columns = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.tokens = torch.zeros((0,), dtype=torch.long, device=self.device)
        self.positions = torch.zeros((0,), dtype=torch.long, device=self.device)
        # the in-graph token choice's inputs, per slot (see CONTROLS), and output
        self.controls = torch.zeros((len(CONTROLS), 0), dtype=torch.float32, device=self.device)
        self.chosen_logprobs = torch.zeros((0,), dtype=torch.float32, device=self.device)
        self._column_ids = self._slot_ids = None
        self._kv_head_ids = torch.arange(self.shape.kv_heads, device=self.device)
        self._graphs: dict[tuple[int, int, bool], tuple[Any, torch.Tensor]] = {}
        self.use_graphs = self.device.type == "cuda"
        self.graph_error: str | None = None  # why graphs were switched off, if they were
        if self.use_graphs and any(self.moe) and not grouped_possible(self.device, self.dtype):
            # the experts' LoRA would run expert by expert, waiting for the host: no capture is tried
            self.use_graphs, self.graph_error = False, f"MoE experts in {self.dtype} take no grouped GEMMs here"
        by_default, why_not = compile_by_default(self.device)
        self.compiled = by_default if compiled is None else compiled
        self.compile_error = None if self.compiled else why_not  # why the pieces are not compiled
        self._pieces = pieces(self.compiled)
        self._choose = compiled_once(choose_in_step) if self.compiled else choose_in_step
        # attention as sdpa (memory-efficient kernel on CUDA) with the hidden columns as a bias, instead of two
        # products and a softmax: opt-in until measured on a GPU (docs/localtinker-gpu.md)
        # a sliding window on the layers the config names (a second mask, made once per step: families.py), and
        # gpt-oss's sink logit per head ([kv heads, group, 1], as the grouped scores broadcast it)
        self.windows = layer_windows(model.config)
        group = self.shape.heads // self.shape.kv_heads
        self.sinks = [None if getattr(layer.self_attn, "sinks", None) is None
                      else layer.self_attn.sinks.detach().reshape(self.shape.kv_heads, group, 1) for layer in self.layers]
        # Gemma 2/3: four norms of weight 1 + w per layer (decode_layer.sandwich_post_attention), soft caps on the
        # attention scores (Gemma 2) and on the logits; Gemma 3 rotates its sliding-window layers by their own
        # frequencies (one table per layer type)
        self.sandwich = self.shape.sandwich
        self.softcap = final_softcap(model.config)
        self.attention_softcap = attention_softcap(model.config)
        self.rotations = layer_rotations(model)
        self._tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        self.sdpa_attention = (os.environ.get(ATTENTION_ENV) == "sdpa" and not any(self.windows)
                               and all(sinks is None for sinks in self.sinks) and not self.attention_softcap)
        self._layer_parts = self._parts()

    @property
    def captured_graphs(self) -> int:
        return len(self._graphs)

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    # ----- pool: one decoder per running batch, kept on the model between batches ----------------

    @classmethod
    def acquire(cls, model: torch.nn.Module) -> StaticDecoder:
        pooled = pooled_decoders(model)
        return pooled.pop() if pooled else cls(model)

    @torch.inference_mode()
    def release(self) -> None:
        """Keeps this decoder for the next batch (its graphs are reused) unless the kept caches would grow
        large: a long sample's cache must not stay allocated under the next training step."""
        pooled = pooled_decoders(self.model)
        kept = self.cache_bytes + sum(decoder.cache_bytes for decoder in pooled)
        total = total_bytes(self.device)
        if len(pooled) < _KEPT_DECODERS and (total is None or kept <= _KEPT_CACHE_SHARE * total):
            self.positions.zero_()
            pooled.append(self)

    # ----- state ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def set_adapter(self, adapter: str | None) -> None:
        compute = self.head.base.weight.dtype
        loads = _Loads()
        fresh = [projection.load(adapter, self.dtype, loads) for layer in self.projections
                 for projection in layer.values()]
        fresh.append(self.head.load(adapter, compute, loads))
        loads.run()
        self._layer_parts = self._parts()
        # An MoE block's expert LoRA is read by its module inside the step: a graph holds the factors (as rounded
        # for the products) it was captured with, so other factors, or the same ones updated, mean new graphs.
        experts_key = tuple(
            (adapter, *((t.data_ptr(), t._version) for t in adapters_of(moe.experts).factors.get(adapter, {}).values()))
            for moe in self.moe if moe is not None)
        if any(fresh) or experts_key != self._experts_key:
            self._experts_key = experts_key
            self._drop_graphs()

    def _parts(self) -> list[tuple]:
        """Each layer's tensors in the order its decode_layer.py pieces take them (the adapter's factors as
        loaded now)."""
        return [
            (layer.input_layernorm.weight, parts["qkv"].parts(), norm_weight(getattr(layer.self_attn, "q_norm", None)),
             norm_weight(getattr(layer.self_attn, "k_norm", None)), parts["o_proj"].parts(),
             layer.post_attention_layernorm.weight, parts["gate_up"].parts() if "gate_up" in parts else None,
             parts["down_proj"].parts() if "down_proj" in parts else None,
             norm_weight(getattr(layer, "pre_feedforward_layernorm", None)),
             norm_weight(getattr(layer, "post_feedforward_layernorm", None)))
            for layer, parts in zip(self.layers, self.projections)
        ]

    def _drop_graphs(self) -> None:
        """Forgets the captured graphs (each frees its own memory pool)."""
        self._graphs.clear()

    @torch.inference_mode()
    def reserve(self, slots: int, columns: int) -> None:
        """Room for ``slots`` rows of ``columns`` positions, grown to power-of-two sizes (contents kept)."""
        slots, columns = bucket(slots, SLOT_FLOOR), bucket(columns, MIN_COLUMNS)
        if slots <= self.slots and columns <= self.columns:
            return
        slots, columns = max(slots, self.slots), max(columns, self.columns)
        shape = (slots, self.shape.kv_heads, columns, self.shape.head_dim)
        keys, values = [], []
        for old_k, old_v in zip(self.keys or [None] * len(self.layers), self.values or [None] * len(self.layers)):
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if old_k is not None:
                k[: self.slots, :, : self.columns] = old_k
                v[: self.slots, :, : self.columns] = old_v
            for cache in (k, v):  # the compiled piece writing into it serves every cache size (no recompile)
                torch._dynamo.maybe_mark_dynamic(cache, 0)
                torch._dynamo.maybe_mark_dynamic(cache, 2)
            keys.append(k)
            values.append(v)
        self.keys, self.values = keys, values
        tokens = torch.zeros((slots,), dtype=torch.long, device=self.device)
        positions = torch.zeros((slots,), dtype=torch.long, device=self.device)
        tokens[: self.slots], positions[: self.slots] = self.tokens, self.positions
        self.tokens, self.positions = tokens, positions
        self.controls = torch.zeros((len(CONTROLS), slots), dtype=torch.float32, device=self.device)
        self.chosen_logprobs = torch.zeros((slots,), dtype=torch.float32, device=self.device)
        self.slots, self.columns = slots, columns
        ids = torch.arange(columns, device=self.device)
        self._tables = {}
        for kind in dict.fromkeys(self.rotations):
            cos, sin = rotation(self.rotary, self.embed.weight[:1][None], ids[None], kind, self.shape.head_dim)
            self._tables[kind] = (cos[0], sin[0])
        self._column_ids = ids
        self._slot_ids = torch.arange(slots, device=self.device)
        self._drop_graphs()

    @torch.inference_mode()
    def prefill(self, prompts: list[tuple[int, ...]], slots: list[list[int]]) -> torch.Tensor:
        """Runs ``prompts`` (each once, packed end to end without padding) through the layers as this decoder's
        own pieces run a step, op by op, and writes each prompt's keys and values into each of its ``slots``
        at columns ``0..len−1``; returns the final-normed hidden states ``[Σ len, hidden]`` in packed order.
        Attention is by prompt (flash varlen on a GPU). Columns for the longest prompt must be reserved.

        transformers' layers took a 16-prompt prefill through ~1200 kernel launches, host-bound on a GPU
        (docs/localtinker-gpu.md); these pieces take about half as many, and prefill and decode share the
        adapter's factors as this decoder holds them."""
        shape = self.shape
        lengths = [len(prompt) for prompt in prompts]
        starts = np.cumsum([0, *lengths[:-1]]).tolist()
        tokens = torch.tensor([t for prompt in prompts for t in prompt], device=self.device)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(self.device)
        # each (slot, packed row) whose key and value the slot takes, and where: (slot, kv head, column)
        pairs = torch.tensor([(slot, start + column) for start, n, owners in zip(starts, lengths, slots)
                              for slot in owners for column in range(n)], dtype=torch.long).reshape(-1, 2)
        slot_of, row_of = pairs.to(self.device).unbind(1)
        wide = (len(pairs), shape.kv_heads)
        index = (slot_of[:, None].expand(wide), self._kv_head_ids[None].expand(wide),
                 positions[row_of][:, None].expand(wide))
        layout = PackedLayout.rows(lengths, self.device)
        tables = {kind: (cos[positions][:, None], sin[positions][:, None]) for kind, (cos, sin) in self._tables.items()}
        x = self.embed(tokens)
        for part, moe, keys, values, window, sinks, kind in zip(
                self._layer_parts, self.moe, self.keys, self.values, self.windows, self.sinks, self.rotations):
            norm, qkv, q_norm, k_norm = part[:4]
            q, k, v = pre_attention(x, norm, qkv, q_norm, k_norm, *tables[kind], shape.heads, shape.kv_heads, shape.eps,
                                    shape.qk_eps, self.sandwich)
            keys.index_put_(index, k[row_of])
            values.index_put_(index, v[row_of])
            q = q.reshape(len(positions), shape.heads, shape.head_dim)
            if sinks is None and not self.attention_softcap:
                out = packed_causal_attention(q, k, v, layout, shape.scale, window)
            else:
                out = _prompt_attention(q, k, v, lengths, shape.scale, window, sinks, self.attention_softcap)
            out = out.reshape(len(positions), shape.heads * shape.head_dim)
            x = self._after_attention(out, x, part, moe, (post_attention, attention_residual, sandwich_post_attention))
        return rms(x, self.norm.weight, shape.eps, self.sandwich)

    @torch.inference_mode()
    def keep(self, index: torch.Tensor, count: int) -> None:
        """Moves rows ``index`` (ascending) to slots ``0..count-1``; the slots after them are free."""
        for k, v in zip(self.keys, self.values):
            k[:count] = k[index]
            v[:count] = v[index]
        self.tokens[:count] = self.tokens[index]
        self.positions[:count] = self.positions[index]
        self.positions[count:] = 0

    # ----- the step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, rows: int, last_position: int) -> torch.Tensor:
        """float32 logits [rows, vocab] of the next token of slots ``0..rows-1``, each reading ``tokens`` at
        ``positions`` (written into the cache first); ``last_position`` is the largest position among them."""
        return self._run(rows, last_position, choose=False)[:rows]

    @torch.inference_mode()
    def step_and_choose(self, rows: int, last_position: int) -> None:
        """:meth:`step`, then each row's next token chosen on the device from ``controls`` as
        ``token_choice.choose_tokens_on_device`` chooses it without top-k/top-p: the token goes to
        ``tokens`` (the next step's input), its logprob to ``chosen_logprobs``, and live rows' ``positions``
        advance. Nothing here waits for the device, so the host can queue the next step before
        it reads this one's tokens (portable_sampling.py)."""
        self._run(rows, last_position, choose=True)

    def _run(self, rows: int, last_position: int, choose: bool) -> torch.Tensor:
        try:
            return self._run_once(rows, last_position, choose)
        except Exception as error:  # noqa: BLE001 - a compiler failure: say why once, decode uncompiled
            if not self.compiled or isinstance(error, (ValueError, torch.OutOfMemoryError)):
                raise
            # The failed call wrote at most this step's keys (rewritten below): tokens and positions move last.
            self.compile_error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            warnings.warn(f"static decode: compiling the decode step failed ({self.compile_error}); "
                          "decoding uncompiled", RuntimeWarning, stacklevel=3)
            self.compiled, self._pieces, self._choose = False, pieces(False), choose_in_step
            self._drop_graphs()
            return self._run_once(rows, last_position, choose)

    def _run_once(self, rows: int, last_position: int, choose: bool) -> torch.Tensor:
        width, columns = bucket(rows), bucket(last_position + 1, MIN_COLUMNS)
        if width > self.slots or columns > self.columns:
            raise ValueError(f"static decode: {rows} rows at position {last_position} exceed the reserved "
                             f"{self.slots} × {self.columns}")
        if not self.use_graphs:
            return self._body(width, columns, choose)
        graph = self._graphs.get((width, columns, choose))
        if graph is None:
            try:
                started = time.perf_counter()
                graph = self._graphs[(width, columns, choose)] = self._capture(width, columns, choose)
                # A new bucket's first step waits for the capture (and, compiled, the compiler): say how long.
                logger.info("static decode: graph for %d rows × %d columns captured in %.1f s%s", width, columns,
                            time.perf_counter() - started, " (layer pieces compiled)" if self.compiled else "")
            except RuntimeError as error:  # an op this torch cannot capture: decode eagerly, and say so once
                self.graph_error = f"{type(error).__name__}: {error}"
                warnings.warn(f"static decode: CUDA graph capture failed ({error}); decoding without graphs",
                              RuntimeWarning, stacklevel=3)
                self.use_graphs = False
                return self._body(width, columns, choose)
        graph[0].replay()
        return graph[1]

    def _capture(self, rows: int, columns: int, choose: bool) -> tuple[Any, torch.Tensor]:
        # The warm-up writes this step's keys into the cache, as the replay then does again; a choosing step
        # also moves tokens and positions on, which are put back before the capture (that runs nothing).
        saved = (self.tokens.clone(), self.positions.clone())
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._body(rows, columns, choose)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.tokens.copy_(saved[0])
        self.positions.copy_(saved[1])
        # Each graph gets its own memory pool (a few logit rows' worth): a pool shared between graphs must
        # outlive them all, and a capture into the handle of one whose graphs were dropped trips the caching
        # allocator's assertion.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._body(rows, columns, choose)
        return graph, out

    def _body(self, rows: int, columns: int, choose: bool) -> torch.Tensor:
        logits = self._forward(rows, columns)
        if not choose:
            return logits
        uniforms, temperatures, greedy, live = self.controls[:, :rows]
        tokens, self.chosen_logprobs[:rows] = self._choose(logits, uniforms, temperatures, greedy)
        self.tokens[:rows] = tokens
        self.positions[:rows] += live.long()
        return logits

    def _after_attention(self, out: torch.Tensor, x: torch.Tensor, part: tuple, moe: torch.nn.Module | None,
                         functions: tuple[Callable, Callable, Callable]) -> torch.Tensor:
        """The rest of a layer after its attention ``out``, by its shape: Gemma's norms around o_proj and the MLP,
        an MoE layer's o_proj then its block (as a module), else o_proj and the MLP. ``functions``: decode_layer's
        post_attention, attention_residual and sandwich_post_attention (the compiled ones in a step)."""
        post, residual, sandwich = functions
        o_proj, post_norm, gate_up, down, pre_mlp_norm, post_mlp_norm = part[4:]
        eps = self.shape.eps
        if self.sandwich:
            return sandwich(out, x, o_proj, post_norm, pre_mlp_norm, gate_up, down, post_mlp_norm, eps)
        if moe is None:
            return post(out, x, o_proj, post_norm, gate_up, down, eps)
        x, normed = residual(out, x, o_proj, post_norm, eps)
        return x + run_moe_block(moe, normed)

    def _forward(self, rows: int, columns: int) -> torch.Tensor:
        shape = self.shape
        tokens, positions = self.tokens[:rows], self.positions[:rows]
        # each rotation table's rows at the step's positions: [rows, 1, dim]
        tables = {kind: (cos[positions][:, None], sin[positions][:, None]) for kind, (cos, sin) in self._tables.items()}
        hidden = (self._column_ids[:columns][None] > positions[:, None])[:, None, None]  # [rows, 1, 1, columns]
        # where this step's keys and values go: (slot, kv head, column = position), each [rows, kv heads]
        wide = (rows, shape.kv_heads)
        index = (self._slot_ids[:rows, None].expand(wide), self._kv_head_ids[None].expand(wide),
                 positions[:, None].expand(wide))
        pre_attention, attention_weights, post_attention, attention_residual, sandwich_post_attention = self._pieces
        bias = None
        if self.sdpa_attention:  # hidden columns as an additive bias, once per step: [rows, 1, 1, columns]
            bias = torch.zeros(hidden.shape, dtype=self.dtype, device=self.device).masked_fill(hidden, float("-inf"))
        windowed = None
        window = next((w for w in self.windows if w), None)
        if window:  # a sliding-window layer also hides the columns at or before position − window
            windowed = hidden | (self._column_ids[:columns][None] <= positions[:, None] - window)[:, None, None]
        x = self.embed(tokens)
        with _sdpa_backend(self.sdpa_attention and self.device.type == "cuda"):
            for part, moe, keys, values, window, sinks, kind in zip(
                    self._layer_parts, self.moe, self.keys, self.values, self.windows, self.sinks, self.rotations):
                norm, qkv, q_norm, k_norm = part[:4]
                q = pre_attention(x, norm, qkv, q_norm, k_norm, *tables[kind], shape.heads, shape.kv_heads,
                                  shape.eps, shape.qk_eps, keys, values, index, self.sandwich)
                keys, values = keys[:rows, :, :columns], values[:rows, :, :columns]
                if bias is not None:
                    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=shape.scale)
                else:
                    weights = attention_weights(torch.matmul(q, keys.transpose(-1, -2)),
                                                hidden if window is None else windowed, shape.scale, sinks,
                                                self.attention_softcap)
                    out = torch.matmul(weights, values)  # [rows, kv heads, group, dim]
                out = out.reshape(rows, shape.heads * shape.head_dim)
                x = self._after_attention(out, x, part, moe, (post_attention, attention_residual,
                                                              sandwich_post_attention))
        logits = project(rms(x, self.norm.weight, shape.eps, self.sandwich), self.head.parts()).float()
        # Gemma's final soft cap, on the float32 logits as chunked_logprobs.output_logits applies it
        return logits if not self.softcap else torch.tanh(logits / self.softcap) * self.softcap
