"""One decoder layer's decode step as pure functions of tensors (static_decode.py's), optionally compiled.

A layer's weights and its adapter's factors come in as arguments, so one compiled graph serves every layer
of a model (and every adapter of its layout). On a GPU a decode step is bound by its number of kernels, not
its bytes (docs/localtinker-gpu.md): between the products, the norms, the rotation, the softmax and the
gated activation run as a few small kernels each when taken op by op, and ``torch.compile`` fuses each run
of them into one. The step's keys and values are written into the cache inside the first piece
(:func:`pre_attention_cached`: ``index_put_`` into the whole cache tensor, which the compiler turns into stores
in the kernel that rotates k — a write into a slice of it would copy the slice); the two attention products
stay outside.

Gemma 2 and 3 (:data:`SANDWICH_FAMILIES`) differ from the Llama shape in four ways, each an argument here: norms
of weight ``1 + w`` applied in float32 (``offset``), a norm after the attention and after the MLP as well as
before each (:func:`sandwich_post_attention`), a GELU (tanh) gate, and Gemma 2's soft cap on the attention
scores (``softcap`` of :func:`attention_weights`).

A projection is ``(weight, bias, A, (s·B)ᵀ)``: the frozen base layer and, for an adapted layer, the adapter's
factors (None for none) in the compute dtype, as lora.py's fused forward computes them. A *joined* projection
is ``(weight, bias, None, (s·B)ᵀ)`` whose weight's last rows are A (static_decode.py's joined weights): one
product gives the base output and ``x Aᵀ`` side by side.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localtinker.engine.device import cuda_capability, runs_triton
from localtinker.engine.families import architecture, text_config

Projection = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
MASKED = torch.finfo(torch.float32).min
COMPILE_ENV = "LOCALTINKER_DECODE_COMPILE"  # "0" keeps a GPU's decode step uncompiled
TRAIN_COMPILE_ENV = "LOCALTINKER_TRAIN_COMPILE"  # "0": the training pieces and the log-softmax run op by op
SANDWICH_FAMILIES = frozenset({"gemma2", "gemma3_text"})  # four (1 + w) norms per layer, a GELU-tanh gate


@dataclass(frozen=True)
class LayerShape:
    """What the pieces take beside tensors, read once from a Llama-shaped model: head sizes, attention scale, the
    norms' epsilons (the q/k norms' for Qwen3, else the layer norms'), and whether its layers are Gemma's
    (``sandwich``: :data:`SANDWICH_FAMILIES`)."""

    head_dim: int
    heads: int
    kv_heads: int
    scale: float
    eps: float
    qk_eps: float
    sandwich: bool = False

    @classmethod
    def of(cls, model: torch.nn.Module) -> LayerShape:
        config = text_config(model.config)
        layer = model.get_decoder().layers[0]
        attention = layer.self_attn
        heads = int(config.num_attention_heads)
        eps = _epsilon(layer.input_layernorm)
        return cls(head_dim=int(attention.head_dim), heads=heads,
                   kv_heads=int(getattr(config, "num_key_value_heads", None) or heads), scale=float(attention.scaling),
                   eps=eps, qk_eps=_epsilon(attention.q_norm) if hasattr(attention, "q_norm") else eps,
                   sandwich=architecture(model.config) in SANDWICH_FAMILIES)


def layer_rotations(model: torch.nn.Module) -> list[str | None]:
    """Each layer's rotation kind, as the model's rotary module takes it: Gemma 3's layer type (its sliding and
    full layers have frequencies of their own), else None (one rotation for every layer)."""
    decoder = model.get_decoder()
    if getattr(decoder.rotary_emb, "layer_types", None) is None:
        return [None] * len(decoder.layers)
    return list(text_config(model.config).layer_types)


def rotation(rotary: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor, kind: str | None,
             head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[1, positions, head_dim]`` from the model's rotary module for one rotation kind
    (:func:`layer_rotations`). gpt-oss's module gives each frequency once (its own rotation pairs the halves):
    repeated, they are what the other families' rotation (:func:`rotate`) takes."""
    cos, sin = rotary(x, positions, *(() if kind is None else (kind,)))
    if cos.shape[-1] * 2 == head_dim:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return cos, sin


def norm_weight(norm: torch.nn.Module | None) -> torch.Tensor | None:
    """A norm module's weight, or None where the layer has no such norm."""
    return None if norm is None else norm.weight


def _epsilon(norm: torch.nn.Module) -> float:
    """A norm's epsilon: ``variance_epsilon`` in the Llama-shaped families, ``eps`` in Gemma's."""
    return float(norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """The families' RMSNorm: float32 statistics, the weight applied in the input's dtype; with ``offset``
    (Gemma), the weight ``1 + w`` applied in float32 and the product rounded once."""
    if offset:
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * (1.0 + weight.float())).to(x.dtype)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def project(x: torch.Tensor, projection: Projection, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``residual + x Wᵀ + b + (x Aᵀ)(s·B)ᵀ``.

    Run op by op, the residual (without a bias) and the adapter's product are added inside the GEMMs
    (``addmm``), saving an elementwise pass each. Compiled, the terms are plain sums instead: an ``addmm`` whose
    addend is a 2-D tensor copies it into its output before the GEMM (six copies per layer and decode step, in
    an H200 profile), while a sum fuses into the kernel that reads the result next (the norm, SiLU × up, the
    rotation)."""
    weight, bias, a, b_t = projection
    if a is None and b_t is not None:  # joined: x Aᵀ comes out of the base product, in its last columns
        joined = F.linear(x, weight, bias)
        out, low_rank = joined.split([b_t.shape[1], b_t.shape[0]], dim=-1)
        if torch.compiler.is_compiling():
            out = out + low_rank @ b_t
            return out if residual is None else out + residual
        out = torch.addmm(out, low_rank, b_t)
        return out if residual is None else out.add_(residual)
    if torch.compiler.is_compiling():
        out = F.linear(x, weight, bias)
        if a is not None:
            out = out + F.linear(x, a) @ b_t
        return out if residual is None else out + residual
    if residual is not None and bias is None:
        out = torch.addmm(residual, x, weight.t())
    else:
        out = F.linear(x, weight, bias)
        if residual is not None:
            out = out + residual
    if a is not None:
        out.addmm_(F.linear(x, a), b_t)
    return out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def pre_attention(x: torch.Tensor, norm: torch.Tensor, qkv: Projection, q_norm: torch.Tensor | None,
                  k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                  eps: float, qk_eps: float, offset: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The normed input's q/k/v as one product, q and k (normed, for Qwen3 and Gemma 3) rotated in one pass: q
    as ``[rows, kv heads, group, dim]`` (a KV head's query heads as a short query sequence), k and v as
    ``[rows, kv heads, dim]``. ``offset``: Gemma's norms (:func:`rms`)."""
    rows, head_dim = x.shape[0], cos.shape[-1]
    q, k, v = project(rms(x, norm, eps, offset), qkv).split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k = q.reshape(rows, heads, head_dim), k.reshape(rows, kv_heads, head_dim)
    if q_norm is not None:
        q, k = rms(q, q_norm, qk_eps, offset), rms(k, k_norm, qk_eps, offset)
    qk = rotate(torch.cat((q, k), dim=1), cos, sin)
    return (qk[:, :heads].reshape(rows, kv_heads, heads // kv_heads, head_dim), qk[:, heads:],
            v.reshape(rows, kv_heads, head_dim))


def pre_attention_cached(x: torch.Tensor, norm: torch.Tensor, qkv: Projection, q_norm: torch.Tensor | None,
                         k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                         eps: float, qk_eps: float, keys: torch.Tensor, values: torch.Tensor,
                         index: tuple[torch.Tensor, torch.Tensor, torch.Tensor], offset: bool = False) -> torch.Tensor:
    """:func:`pre_attention` for a decode step: k and v go into the layer's cache ``keys`` / ``values`` ``[slots,
    kv heads, columns, dim]`` at ``index`` (slot, kv head, column, each ``[rows, kv heads]``); returns q, contiguous
    (a view of the rotation's output would be copied before the attention's first product: a kernel per layer)."""
    q, k, v = pre_attention(x, norm, qkv, q_norm, k_norm, cos, sin, heads, kv_heads, eps, qk_eps, offset)
    keys.index_put_(index, k)
    values.index_put_(index, v)
    return q.contiguous()


def attention_weights(scores: torch.Tensor, hidden: torch.Tensor, scale: float,
                      sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """transformers' eager formula: scaled float32 scores (soft-capped, ``cap·tanh(z / cap)``, for Gemma 2),
    hidden columns masked, softmax, back to the dtype. With ``sinks`` (gpt-oss; broadcast against the scores but
    for their last dimension), each row's sink logit joins the softmax as one more column, dropped after it."""
    z = scores.float() * scale
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    z = z.masked_fill(hidden, MASKED)
    if sinks is None:
        return torch.softmax(z, dim=-1).to(scores.dtype)
    column = sinks.float().expand(*z.shape[:-1], 1)
    return torch.softmax(torch.cat((z, column), dim=-1), dim=-1)[..., :-1].to(scores.dtype)


def post_attention(out: torch.Tensor, x: torch.Tensor, o_proj: Projection, norm: torch.Tensor, gate_up: Projection,
                   down: Projection, eps: float) -> torch.Tensor:
    """o_proj onto the residual stream, then the MLP: gate and up as one product, SiLU gate × up, down."""
    x = project(out, o_proj, residual=x)
    gate, up = project(rms(x, norm, eps), gate_up).chunk(2, dim=-1)
    return project(F.silu(gate) * up, down, residual=x)


def attention_residual(out: torch.Tensor, x: torch.Tensor, o_proj: Projection, norm: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """o_proj onto the residual stream, and its norm: what an MoE layer's block (run as its own module) takes."""
    x = project(out, o_proj, residual=x)
    return x, rms(x, norm, eps)


def sandwich_post_attention(out: torch.Tensor, x: torch.Tensor, o_proj: Projection, post_attention_norm: torch.Tensor,
                            pre_mlp_norm: torch.Tensor, gate_up: Projection, down: Projection,
                            post_mlp_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma 2/3's rest of the layer: o_proj normed onto the residual stream, then the MLP (GELU-tanh gate × up)
    between its own two norms, onto it; every norm of weight ``1 + w`` (:func:`rms` with ``offset``)."""
    x = x + rms(project(out, o_proj), post_attention_norm, eps, True)
    gate, up = project(rms(x, pre_mlp_norm, eps, True), gate_up).chunk(2, dim=-1)
    return x + rms(project(F.gelu(gate, approximate="tanh") * up, down), post_mlp_norm, eps, True)


PIECES = (pre_attention_cached, attention_weights, post_attention, attention_residual, sandwich_post_attention)
_compiled: dict[Callable, Callable] = {}


def pieces(compiled: bool) -> tuple[Callable, ...]:
    """The pieces, each compiled once per process when asked (graphs are then keyed by shapes, not by which
    layer or model calls them)."""
    return tuple(compiled_once(fn) for fn in PIECES) if compiled else PIECES


def compiled_once(fn: Callable, dynamic: bool | None = None) -> Callable:
    """``fn`` through ``torch.compile`` (whole graph; ``dynamic`` as torch.compile takes it), once per process."""
    allow_recompiles()
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, fullgraph=True, dynamic=dynamic)
    return _compiled[fn]


def allow_recompiles(limit: int = 64) -> None:
    """Raises dynamo's per-function graph limit (8): a piece gets a graph per model shape, grad mode and
    input that requires grad or not, and one process may serve several base models; past the limit dynamo
    silently runs the piece uncompiled."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name) and getattr(config, name) < limit:
            setattr(config, name, limit)
            return


def compile_by_default(device: torch.device, env: str = COMPILE_ENV) -> tuple[bool, str | None]:
    """(whether to compile, why not): on a CUDA card Triton runs on (sm70 on) with Triton importable, unless
    ``$env`` is ``0`` (``LOCALTINKER_DECODE_COMPILE`` for the decode step). ``$env`` = ``1`` compiles on other
    devices too, through inductor's C++ code: nothing a CPU user gains (its own path is tuned), but how
    ``bench_gpu.py --smoke`` runs the compiled parts of the GPU bench before a GPU does."""
    setting = os.environ.get(env)
    if setting == "0":
        return False, f"{env}=0"
    if device.type != "cuda":
        return (True, None) if setting == "1" else (False, f"not compiled on {device.type}")
    if importlib.util.find_spec("triton") is None:
        return False, "Triton is not installed"
    if not runs_triton(device):
        major, minor = cuda_capability(device)
        return False, f"Triton does not run on compute capability {major}.{minor} (it needs 7.0)"
    return True, None
