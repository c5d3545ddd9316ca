"""The portable trainer's decoder forward for the Llama-shaped families, as decode_layer.py's pieces with autograd.

transformers' decoder layer takes a LoRA training step through several hundred small kernels per layer:
float32 norm statistics op by op, the rotation, one product per projection and per LoRA factor, a cast of each
factor on every call. On a GPU the 1B shape's step was bound by those launches, not by its products
(docs/localtinker-gpu.md). Here a packed micro-batch (packed_rows.py) runs the same pure functions as the
static decoder instead: q/k/v and gate/up as one product each over the weight views the modules share
(static_decode.py), the adapter's float32 factors stacked, scaled and cast inside the piece (so their gradients
reach the float32 parameters, as in lora.py's fused forward), the residuals added inside the products. On CUDA
with Triton the two pieces go through ``torch.compile``, dynamic in the token count, so one graph per model serves
every micro-batch and each run of elementwise work becomes one kernel. Attention runs between the pieces, by the
micro-batch's segments (packed_layout.py: a prompt shared by several datums runs once): flash varlen on CUDA in
bf16/fp16, one sdpa per segment elsewhere.

Taken where static decode is (Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE, gpt-oss, Gemma 2 and 3) and the active
adapter is plain (lora.py); anything else runs transformers' layers. An MoE layer's block (router, experts and
their LoRA: expert_lora.py) runs as its own module between o_proj's piece and the next layer, as in the static
decoder. Sliding-window layers pass their window to the packed attention, gpt-oss's layers their sinks and Gemma 2's
the soft cap on their scores (beyond_flash.py). ``LOCALTINKER_TRAIN_LAYERS=0`` turns
this path off, ``LOCALTINKER_TRAIN_COMPILE=0`` keeps it uncompiled; ``LOCALTINKER_TRAIN_GRAPHS=1`` replays the
compiled pieces as CUDA graphs over a few buckets of packed length (opt-in until measured on a GPU).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from localtinker.engine.decode_layer import (
    TRAIN_COMPILE_ENV, LayerShape, allow_recompiles, attention_residual, compile_by_default, layer_rotations,
    norm_weight, post_attention, pre_attention, rotation, sandwich_post_attention,
)
from localtinker.engine.expert_lora import adapters_of
from localtinker.engine.families import attention_softcap, layer_windows
from localtinker.engine.packed_layout import PackedLayout
from localtinker.engine.portable_attention import packed_causal_attention
from localtinker.engine.static_decode import (
    frozen_layer, moe_block, run_moe_block, shared_weights, static_decode_supported,
)

LAYERS_ENV = "LOCALTINKER_TRAIN_LAYERS"  # "0": the trainer runs transformers' layers
GRAPHS_ENV = "LOCALTINKER_TRAIN_GRAPHS"  # "1": the compiled pieces replay as CUDA graphs (see PackedLayers.graphs)
_MIN_BUCKET = 256  # packed tokens of the smallest graph bucket
_KEPT = "_localtinker_packed_layers"  # on the causal LM: its PackedLayers (False: not taken), decided once
_PROBE_TOKENS = 8
logger = logging.getLogger("localtinker.engine")

# A group's adapter: the A factors, the B factors and the scalings of its projections (each tuple empty when
# the group is not adapted).
Factors = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], tuple[float, ...]]
_NO_FACTORS: Factors = ((), (), ())


def layers_by_default(device: torch.device) -> bool:
    """The written-out layers on CUDA devices, unless ``LOCALTINKER_TRAIN_LAYERS=0``."""
    return device.type == "cuda" and os.environ.get(LAYERS_ENV) != "0"


def graphs_by_default(device: torch.device) -> bool:
    """CUDA graphs of the training pieces where asked (``LOCALTINKER_TRAIN_GRAPHS=1``) on a CUDA device: off by
    default until measured on a GPU (docs/localtinker-gpu.md)."""
    return device.type == "cuda" and os.environ.get(GRAPHS_ENV) == "1"


def token_bucket(tokens: int) -> int:
    """``tokens`` rounded up to a graph bucket: at least 256, then four buckets per doubling, so a micro-batch
    pads at most 25% and a few graphs serve every length up to the micro-batch budget."""
    if tokens <= _MIN_BUCKET:
        return _MIN_BUCKET
    step = 1 << (tokens.bit_length() - 3)
    return -(-tokens // step) * step


def _lora(dtype: torch.dtype, factors: Factors) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A stacked and (s·B)ᵀ block-diagonal, in ``dtype``: one product each for the whole group."""
    a_parts, b_parts, scales = factors
    if not a_parts:
        return None, None
    a = torch.cat(a_parts).to(dtype) if len(a_parts) > 1 else a_parts[0].to(dtype)
    scaled = [(b * s).t() for b, s in zip(b_parts, scales)]
    b_t = torch.block_diag(*scaled) if len(scaled) > 1 else scaled[0]
    return a, b_t.to(dtype)


def train_pre_attention(x: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        factors: Factors, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                        cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, eps: float,
                        qk_eps: float, offset: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[tokens, heads, dim]``, k and v ``[tokens, kv heads, dim]`` of a layer's normed input, rotated; each
    contiguous, as the flash kernel takes them: compiled, the kernels that compute them write them so, where views
    of the rotation's and the product's outputs were copied before the kernel (three copies per layer forward).
    ``offset``: Gemma's norms (decode_layer.rms)."""
    q, k, v = pre_attention(x, norm, (weight, bias, *_lora(x.dtype, factors)), q_norm, k_norm, cos, sin, heads,
                            kv_heads, eps, qk_eps, offset)
    return q.reshape(q.shape[0], heads, q.shape[-1]).contiguous(), k.contiguous(), v.contiguous()


def train_post_attention(out: torch.Tensor, x: torch.Tensor, o_proj: tuple, o_factors: Factors, norm: torch.Tensor,
                         gate_up: tuple, gate_up_factors: Factors, down: tuple, down_factors: Factors,
                         eps: float) -> torch.Tensor:
    """o_proj onto the residual stream, then the MLP (decode_layer.post_attention); projections are
    ``(weight, bias)``."""
    dtype = x.dtype
    return post_attention(out, x, (*o_proj, *_lora(dtype, o_factors)), norm, (*gate_up, *_lora(dtype, gate_up_factors)),
                          (*down, *_lora(dtype, down_factors)), eps)


def train_attention_residual(out: torch.Tensor, x: torch.Tensor, o_proj: tuple, o_factors: Factors,
                             norm: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """o_proj onto the residual stream, and its norm: what an MoE layer's block takes (it runs as its own
    module, decode_layer.attention_residual)."""
    return attention_residual(out, x, (*o_proj, *_lora(x.dtype, o_factors)), norm, eps)


def train_sandwich_post_attention(out: torch.Tensor, x: torch.Tensor, o_proj: tuple, o_factors: Factors,
                                  norm: torch.Tensor, pre_mlp_norm: torch.Tensor, gate_up: tuple,
                                  gate_up_factors: Factors, down: tuple, down_factors: Factors,
                                  post_mlp_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma 3's rest of the layer (decode_layer.sandwich_post_attention): o_proj normed onto the residual
    stream, then the GELU MLP between its own two norms."""
    dtype = x.dtype
    return sandwich_post_attention(out, x, (*o_proj, *_lora(dtype, o_factors)), norm, pre_mlp_norm,
                                   (*gate_up, *_lora(dtype, gate_up_factors)), (*down, *_lora(dtype, down_factors)),
                                   post_mlp_norm, eps)


PIECES = (train_pre_attention, train_post_attention, train_attention_residual, train_sandwich_post_attention)
_compiled: dict[tuple[Callable, bool], Callable] = {}


def pieces(compiled: bool, graphs: bool = False) -> tuple[Callable, ...]:
    """The pieces, compiled once per process when asked (dynamic in the token count: tensors' first
    dimension is marked dynamic on every call); with ``graphs``, in inductor's ``reduce-overhead`` mode, whose
    compiled code replays as CUDA graphs (one per piece, layer, grad mode and token bucket)."""
    if not compiled:
        return PIECES
    allow_recompiles()
    mode = "reduce-overhead" if graphs else None
    return tuple(_compiled.setdefault((fn, graphs), torch.compile(fn, fullgraph=True, mode=mode)) for fn in PIECES)


def _active_factors(modules: Sequence[torch.nn.Module]) -> Factors | None:
    """The active adapter's factors on ``modules`` (one group), ``_NO_FACTORS`` where none adapts them, None
    where this path cannot compute them (several active adapters, dropout, a variant, merged weights, or an
    adapter on some of the group only): transformers' layers then run."""
    found = []
    for module in modules:
        lora_a = getattr(module, "lora_A", None)
        active = [] if lora_a is None or module.disable_adapters else [
            name for name in module.active_adapters if name in lora_a]
        if not active:
            found.append(None)
            continue
        name = active[0]
        if (len(active) != 1 or module.merged or name in getattr(module, "lora_variant", {})
                or not isinstance(module.lora_dropout[name], torch.nn.Identity)):
            return None
        found.append((lora_a[name].weight, module.lora_B[name].weight, float(module.scaling[name])))
    if all(f is None for f in found):
        return _NO_FACTORS
    if any(f is None for f in found):
        return None
    a_parts, b_parts, scales = zip(*found)
    return tuple(a_parts), tuple(b_parts), tuple(scales)


class LayerParts(NamedTuple):
    """One layer's tensors as the pieces take them: norms' weights, each group's (weight, bias) and factors."""

    norm: torch.Tensor
    qkv: tuple
    qkv_factors: Factors
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: tuple
    o_factors: Factors
    post_norm: torch.Tensor
    gate_up: tuple  # () in an MoE layer
    gate_up_factors: Factors
    down: tuple  # () in an MoE layer
    down_factors: Factors
    moe: torch.nn.Module | None = None  # an MoE layer's block, run as its own module
    window: int | None = None  # a sliding-window layer's window
    pre_mlp_norm: torch.Tensor | None = None  # Gemma 3's norms before and after the MLP (with post_norm after
    post_mlp_norm: torch.Tensor | None = None  # the attention): decode_layer.sandwich_post_attention
    rotation: str | None = None  # Gemma 3: the layer type whose rotation frequencies the layer takes
    sinks: torch.Tensor | None = None  # gpt-oss: each head's sink logit [heads]

    def trained(self) -> list[torch.Tensor]:
        """The adapter's factor parameters the pieces read (not the experts' own, which their block reads)."""
        groups = (self.qkv_factors, self.o_factors, self.gate_up_factors, self.down_factors)
        return [tensor for a_parts, b_parts, _ in groups for tensor in (*a_parts, *b_parts)]

    def trainable(self) -> list[torch.Tensor]:
        """Every tensor of the layer a backward may give a gradient: the pieces' factors and the block's."""
        if self.moe is None:
            return self.trained()
        experts = adapters_of(self.moe.experts)  # the experts' factors live beside the module (expert_lora.py)
        return [*self.trained(), *experts.factors.get(experts.active, {}).values()]


def _mark_tokens_dynamic(*tensors: torch.Tensor | None) -> None:
    for tensor in tensors:
        if tensor is not None:
            torch._dynamo.maybe_mark_dynamic(tensor, 0)


class PackedLayers:
    """One base model's decoder forward over packed rows (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, compiled: bool | None = None, graphs: bool | None = None) -> None:
        decoder = model.get_decoder()
        self.embed, self.norm, self.rotary = decoder.embed_tokens, decoder.norm, decoder.rotary_emb
        self.layers = list(decoder.layers)
        self.shape = LayerShape.of(model)
        self.device = self.embed.weight.device
        self.windows = layer_windows(model.config)  # each layer's sliding window (None: it attends fully)
        # Gemma 3: four norms of weight 1 + w per layer, a GELU gate, each layer type rotated by its own frequencies
        self.sandwich = self.shape.sandwich
        self.rotations = layer_rotations(model)
        self.attention_softcap = attention_softcap(model.config)  # Gemma 2
        by_default, why_not = compile_by_default(self.device, TRAIN_COMPILE_ENV)
        self.compiled = by_default if compiled is None else compiled
        self.compile_error: str | None = None if self.compiled else why_not
        # CUDA graphs of the compiled pieces: a step's host time is then a replay per piece rather than the
        # compiled code's own launches (~1 ms per call on a 1B model, docs/localtinker-gpu.md)
        self.graphs = self.compiled and (graphs_by_default(self.device) if graphs is None else graphs)
        self._pieces = pieces(self.compiled, self.graphs)
        self._probed = not self.compiled
        # each layer's projection groups: one product per group (q/k/v and gate/up over shared weights); an MoE
        # layer's block instead of gate/up and down
        self._moe = [moe_block(layer) for layer in self.layers]
        self._groups = [
            {"qkv": [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
             "o_proj": [layer.self_attn.o_proj],
             **({} if moe is not None else {"gate_up": [layer.mlp.gate_proj, layer.mlp.up_proj],
                                           "down": [layer.mlp.down_proj]})}
            for layer, moe in zip(self.layers, self._moe)
        ]

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> PackedLayers | None:
        """The model's PackedLayers (built once), or None where its family is not written out here (decided once)."""
        kept = model.__dict__.get(_KEPT)
        if kept is None:
            kept = model.__dict__[_KEPT] = cls(model) if _written_out(model) else False
        return kept or None

    def _layer_parts(self) -> list[LayerParts] | None:
        """Each layer's tensors for the pieces, with the active adapter's factors; None where some group's
        adapter is not plain."""
        parts = []
        for layer, groups, moe, window, kind in zip(self.layers, self._groups, self._moe, self.windows,
                                                    self.rotations):
            factors = {name: _active_factors(modules) for name, modules in groups.items()}
            if any(f is None for f in factors.values()):
                return None
            # (weight, bias) of each group; q/k/v and gate/up as views of one tensor (kept once made)
            bases = {name: shared_weights([frozen_layer(m) for m in modules]) for name, modules in groups.items()}
            q_norm, k_norm = getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)
            part = LayerParts(
                layer.input_layernorm.weight, bases["qkv"], factors["qkv"], None if q_norm is None else q_norm.weight,
                None if k_norm is None else k_norm.weight, bases["o_proj"], factors["o_proj"],
                layer.post_attention_layernorm.weight, bases.get("gate_up", ()), factors.get("gate_up", _NO_FACTORS),
                bases.get("down", ()), factors.get("down", _NO_FACTORS), moe, window,
                norm_weight(getattr(layer, "pre_feedforward_layernorm", None)),
                norm_weight(getattr(layer, "post_feedforward_layernorm", None)), kind,
                getattr(layer.self_attn, "sinks", None))
            if self.graphs:
                _mark_static(part)
            parts.append(part)
        return parts

    def computes_active_adapter(self) -> bool:
        """Whether :meth:`hidden` computes the adapter active now (else transformers' layers must run)."""
        return self._layer_parts() is not None

    def hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, layout: PackedLayout) -> torch.Tensor | None:
        """The final-normed hidden states ``[tokens, hidden]`` of a packed micro-batch (packed_layout.py: its
        tokens' positions and attention segments, on the device); None where the active adapter is not one this
        path computes (the caller then runs transformers' layers)."""
        parts = self._layer_parts()
        if parts is None:
            return None
        if not self._probed:
            self._probe(parts)
        try:
            if self.graphs:
                return self._graphed_forward(parts, input_ids, position_ids, layout)
            return self._forward(parts, input_ids, position_ids, layout)
        except Exception as error:  # noqa: BLE001 - a compiler failure: say why once, run uncompiled
            if not self.compiled or isinstance(error, (ValueError, torch.OutOfMemoryError)):
                raise
            if self.graphs:  # the graphs failed: the compiled pieces without them
                self._ungraph(error)
            else:
                self._uncompile(error)
            return self._forward(parts, input_ids, position_ids, layout)

    def set_graphs(self, graphs: bool) -> None:
        """Turns the pieces' CUDA graphs on or off (compiled pieces only; the bench compares both in one process)."""
        self.graphs = self.compiled and graphs
        self._pieces = pieces(self.compiled, self.graphs)

    def _graphed_forward(self, parts: list[LayerParts], input_ids: torch.Tensor, position_ids: torch.Tensor,
                         layout: PackedLayout) -> torch.Tensor:
        """:meth:`_forward` with the pieces replayed as CUDA graphs: the micro-batch padded to its
        :func:`token_bucket` (the padding a segment of its own, its rows dropped after), a new graph step begun
        (the previous micro-batch's outputs are consumed by then), and the adapter's gradients allocated before
        the backward, so that it adds into them rather than keeping a gradient that lives in the graphs' memory
        (the next replay would overwrite it)."""
        tokens = int(input_ids.shape[0])
        total = token_bucket(tokens)
        if total > tokens:
            pad = torch.arange(total - tokens, device=input_ids.device)
            input_ids = torch.cat([input_ids, torch.zeros_like(pad)])
            position_ids = torch.cat([position_ids, pad])
            layout = layout.padded(tokens, total)
        torch.compiler.cudagraph_mark_step_begin()
        if torch.is_grad_enabled():
            for part in parts:
                for tensor in part.trained():
                    if tensor.requires_grad and tensor.grad is None:
                        tensor.grad = torch.zeros_like(tensor)
        return self._forward(parts, input_ids, position_ids, layout)[:tokens]

    def _forward(self, parts: list[LayerParts], input_ids: torch.Tensor, position_ids: torch.Tensor,
                 layout: PackedLayout) -> torch.Tensor:
        x = self.embed(input_ids)
        rotations = self._rotation(x, position_ids)
        for part in parts:
            x = self._layer(x, part, rotations, layout)
        return self.norm(x)

    def _rotation(self, x: torch.Tensor, positions: torch.Tensor) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """cos and sin ``[tokens, 1, dim]`` of the rows' positions, per rotation kind (one but for Gemma 3)."""
        rotations = {}
        for kind in dict.fromkeys(self.rotations):
            cos, sin = rotation(self.rotary, x[None], positions[None], kind, self.shape.head_dim)
            cos, sin = cos[0][:, None], sin[0][:, None]
            if self.compiled:
                _mark_tokens_dynamic(cos, sin)
            rotations[kind] = cos, sin
        return rotations

    def _layer(self, x: torch.Tensor, part: LayerParts, rotations: dict[str | None, tuple[torch.Tensor, torch.Tensor]],
               layout: PackedLayout) -> torch.Tensor:
        """One decoder layer: the pre piece, attention over the packed rows, the post piece (an MoE layer: o_proj's
        piece, then its block as a module)."""
        (norm, qkv, qkv_factors, q_norm, k_norm, o_proj, o_factors, post_norm, gate_up, gate_up_factors, down,
         down_factors, moe, window, pre_mlp_norm, post_mlp_norm, kind, sinks) = part
        pre, post, residual, sandwich = self._pieces
        shape = self.shape
        if self.compiled:
            _mark_tokens_dynamic(x)
        q, k, v = pre(x, norm, *qkv, qkv_factors, q_norm, k_norm, *rotations[kind], shape.heads, shape.kv_heads,
                      shape.eps, shape.qk_eps, self.sandwich)
        out = packed_causal_attention(q, k, v, layout, shape.scale, window, sinks, self.attention_softcap)
        out = out.reshape(out.shape[0], shape.heads * shape.head_dim)
        if self.compiled:
            _mark_tokens_dynamic(out)
        if self.sandwich:
            return sandwich(out, x, o_proj, o_factors, post_norm, pre_mlp_norm, gate_up, gate_up_factors, down,
                            down_factors, post_mlp_norm, shape.eps)
        if moe is not None:
            x, normed = residual(out, x, o_proj, o_factors, post_norm, shape.eps)
            return x + run_moe_block(moe, normed)
        return post(out, x, o_proj, o_factors, post_norm, gate_up, gate_up_factors, down, down_factors, shape.eps)

    def _probe(self, parts: list[LayerParts]) -> None:
        """Compiles the pieces once, forward and backward, on a few tokens through the first layer of each kind,
        dense and MoE (the backward is compiled at its first call, where a failure could not fall back): a compiler
        that fails here leaves the path uncompiled, with the reason in ``compile_error``; with CUDA graphs, a failure
        turns the graphs off and probes the compiled pieces again."""
        self._probed = True
        started = time.perf_counter()
        # the first training step of a process waits for the compiler (tens of seconds on a GPU): say so
        logger.info("packed layers: compiling the training layer pieces (once per process and model shape)")
        tokens = _PROBE_TOKENS
        probed = list({part.moe is None: part for part in reversed(parts)}.values())  # the first of each kind
        factors = [tensor for part in probed for tensor in part.trainable()]
        kept_grads = [t.grad for t in factors]  # a step's gradients accumulated so far stay as they are
        for tensor in factors:
            tensor.grad = None  # (the backward would add into them in place)
        try:
            if self.graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.inference_mode(False), torch.enable_grad():
                x = torch.randn((tokens, self.embed.weight.shape[1]), device=self.device, dtype=self.embed.weight.dtype,
                                requires_grad=True)
                rotations = self._rotation(x, torch.arange(tokens, device=self.device))
                layout = PackedLayout.rows([tokens], self.device)
                for part in probed:
                    self._layer(x, part, rotations, layout).float().square().mean().backward()
            with torch.inference_mode():
                for part in probed:
                    self._layer(x.detach(), part, rotations, layout)
        except Exception as error:  # noqa: BLE001 - any compiler failure
            if isinstance(error, torch.OutOfMemoryError):
                raise
            graphs = self.graphs
            if graphs:  # the compiled pieces may still work without their graphs: probe them again
                self._ungraph(error)
            else:
                self._uncompile(error)
        else:
            graphs = False
            logger.info("packed layers: pieces compiled in %.1f s", time.perf_counter() - started)
        finally:
            for tensor, grad in zip(factors, kept_grads):
                tensor.grad = grad
        if graphs:
            self._probed = False
            self._probe(parts)

    def _ungraph(self, error: Exception) -> None:
        self.compile_error = f"CUDA graphs: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        warnings.warn(f"packed layers: replaying the training pieces as CUDA graphs failed ({self.compile_error}); "
                      "running them compiled without graphs", RuntimeWarning, stacklevel=3)
        self.set_graphs(False)

    def _uncompile(self, error: Exception) -> None:
        self.compile_error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        warnings.warn(f"packed layers: compiling the training layers failed ({self.compile_error}); running them "
                      "uncompiled", RuntimeWarning, stacklevel=3)
        self.compiled, self.graphs, self._pieces = False, False, pieces(False)


def _mark_static(part: LayerParts) -> None:
    """Tells the graphs that a layer's weights, norms and adapter factors keep their addresses (the optimizer
    updates the factors in place), so a replay reads them where they are instead of copying each into the
    graph's own input buffers. Unguarded: a tensor that does move makes the graph record again, not recompile."""
    tensors = [part.norm, *part.qkv, part.q_norm, part.k_norm, *part.o_proj, part.post_norm, *part.gate_up,
               *part.down, part.pre_mlp_norm, part.post_mlp_norm, part.sinks, *part.trained()]
    for tensor in tensors:
        if tensor is not None and getattr(tensor, "_dynamo_static_input_type", None) is None:
            torch._dynamo.mark_static_address(tensor)


def _written_out(model: torch.nn.Module) -> bool:
    """Whether this path computes ``model``'s layers: the static decoder's families, MoE blocks, attention sinks and
    soft-capped scores included."""
    return static_decode_supported(model)
