"""The portable sampler's decode step over a preallocated KV cache, replayed as a CUDA graph on a GPU.

A decode step through transformers' layers is well over a thousand kernel launches for a 1B model; on a
GPU the host cannot issue them as fast as the card runs them (docs/localtinker-gpu.md). This step is
written out for the Llama-shaped families (Llama, Qwen2, Qwen3, Mistral without sliding windows) over
buffers that never move, so the whole step is captured once per (rows, columns) bucket and replayed with
one launch.

Layout: ``keys[layer]`` / ``values[layer]`` are ``[slots, kv heads, columns, head dim]``; a row's token at
position *p* sits in column *p* (right-padded, unlike ``kv_rows``'s left padding), so a row attends to the
columns ``≤ its position`` and needs no mask tensor from the host. Rows live in slots ``0..n-1``; a finished
row's slot is filled by compaction. Inputs (``tokens``, ``positions``) are written in place before each
replay. The LoRA factors of the sampler's adapter are copied into buffers of the decoder's own, so one
set of graphs serves every adapter of the same layout (an RL loop samples a new snapshot every step).

Attention groups a KV head's query heads as a short query sequence (``[rows, kv heads, group, dim]``)
against that head's cache, so no key is repeated per query head, and is written as two products with a
float32 softmax between (transformers' eager formula): for bf16 on a Hopper card sdpa picks its cuDNN
backend, whose capture fails and leaves the CUDA generator unusable (docs/localtinker-gpu.md). The same
code runs eagerly on a CPU, where the tests check it against transformers' forward.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F

from localtinker.engine.families import architecture, final_softcap, text_config, uses_sliding_windows

STATIC_DECODE_FAMILIES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
MIN_COLUMNS = 128  # a graph is captured per power-of-two bucket of rows and of attended columns
_POOL = "_localtinker_static_decoders"  # on the base model: decoders whose batch has drained, graphs kept
_KEPT_DECODERS = 2
_KEPT_CACHE_SHARE = 1 / 8  # of the device's memory: the pooled decoders' caches together, at most
_MASKED = torch.finfo(torch.float32).min


def pooled_decoders(model: torch.nn.Module) -> list[StaticDecoder]:
    """The decoders kept on ``model`` between batches."""
    return model.__dict__.setdefault(_POOL, [])


def static_decode_supported(model: torch.nn.Module) -> bool:
    """Whether :class:`StaticDecoder` computes this model's own decode step."""
    config = model.config
    text = text_config(config)
    return (architecture(config) in STATIC_DECODE_FAMILIES and not final_softcap(config)
            and not uses_sliding_windows(config) and getattr(text, "hidden_act", "silu") == "silu"
            and not any(p.dim() == 3 for p in model.parameters()))


def bucket(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


class _Projection:
    """One linear of the step: its frozen base layer and, for an adapted layer, the adapter's factors
    rounded to the compute dtype in buffers of fixed address (A and (s·B)ᵀ, as lora.py's fused forward)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.base = getattr(module, "base_layer", module)
        self.a: torch.Tensor | None = None
        self.b_t: torch.Tensor | None = None

    def load(self, adapter: str | None, compute: torch.dtype) -> bool:
        """Copies ``adapter``'s factors in (zeros for a layer it does not adapt); True when the buffers
        were (re)allocated, which invalidates captured graphs."""
        lora_a = getattr(self.module, "lora_A", None)
        if adapter is None or lora_a is None or adapter not in lora_a:
            if self.a is not None:
                self.a.zero_()
                self.b_t.zero_()
            return False
        a = lora_a[adapter].weight
        b_t = (self.module.lora_B[adapter].weight * self.module.scaling[adapter]).t()
        fresh = self.a is None or self.a.shape != a.shape or self.a.dtype != compute
        if fresh:
            self.a = torch.empty(a.shape, dtype=compute, device=a.device)
            self.b_t = torch.empty(b_t.shape, dtype=compute, device=a.device)
        self.a.copy_(a)
        self.b_t.copy_(b_t)
        return fresh

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``residual + base(x) + (x Aᵀ)(s·B)ᵀ``; the residual is added inside the base product's GEMM."""
        base = self.base
        if residual is None:
            out = base(x)
        elif type(base) is torch.nn.Linear and base.bias is None:
            out = torch.addmm(residual, x, base.weight.t())
        else:
            out = base(x) + residual
        if self.a is not None:
            out.addmm_(F.linear(x.to(out.dtype), self.a), self.b_t)
        return out


class _SharedInput:
    """Projections that read the same input (q/k/v; gate/up): their base products, then one product of the
    input with all their A factors stacked, each output taking its slice through its (s·B)ᵀ."""

    def __init__(self, projections: list[_Projection]) -> None:
        self.projections = projections
        self.a: torch.Tensor | None = None

    def load(self, adapter: str | None, compute: torch.dtype) -> bool:
        fresh = any([projection.load(adapter, compute) for projection in self.projections])
        factors = [projection.a for projection in self.projections]
        if any(a is None for a in factors):  # a layout that adapts only some of them: one product each
            self.a = None
            return fresh
        rows = sum(a.shape[0] for a in factors)
        if self.a is None or self.a.shape[0] != rows or self.a.dtype != compute:
            self.a = torch.empty((rows, factors[0].shape[1]), dtype=compute, device=factors[0].device)
            fresh = True
        torch.cat(factors, out=self.a)
        return fresh

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.a is None:
            return [projection(x) for projection in self.projections]
        outs = [projection.base(x) for projection in self.projections]
        low = F.linear(x.to(outs[0].dtype), self.a)  # [rows, Σ ranks]
        start = 0
        for projection, out in zip(self.projections, outs):
            rank = projection.b_t.shape[0]
            out.addmm_(low[:, start : start + rank], projection.b_t)
            start += rank
        return outs


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The families' RMSNorm (float32 statistics, the weight applied in the input's dtype) through torch's
    fused kernel: one launch where the module's own forward makes six."""
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)


class StaticDecoder:
    """Decode steps of one base model over its own KV buffers (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        decoder = model.get_decoder()
        self.embed, self.norm, self.rotary = decoder.embed_tokens, decoder.norm, decoder.rotary_emb
        self.layers = list(decoder.layers)
        self.head = _Projection(model.get_output_embeddings())
        attention = self.layers[0].self_attn
        config = text_config(model.config)
        self.head_dim = int(attention.head_dim)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.scale = float(attention.scaling)
        self.device, self.dtype = self.embed.weight.device, self.embed.weight.dtype
        self.projections = [
            {"qkv": _SharedInput([_Projection(getattr(layer.self_attn, n)) for n in ("q_proj", "k_proj", "v_proj")]),
             "o_proj": _Projection(layer.self_attn.o_proj),
             "gate_up": _SharedInput([_Projection(getattr(layer.mlp, name)) for name in ("gate_proj", "up_proj")]),
             "down_proj": _Projection(layer.mlp.down_proj)}
            for layer in self.layers
        ]
        self.slots = self.columns = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.tokens = torch.zeros((0,), dtype=torch.long, device=self.device)
        self.positions = torch.zeros((0,), dtype=torch.long, device=self.device)
        self._cos = self._sin = self._column_ids = None
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.use_graphs = self.device.type == "cuda"
        self.graph_error: str | None = None  # why graphs were switched off, if they were

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
        small = self.device.type != "cuda" or kept <= _KEPT_CACHE_SHARE * torch.cuda.get_device_properties(
            self.device).total_memory
        if len(pooled) < _KEPT_DECODERS and small:
            self.positions.zero_()
            pooled.append(self)

    # ----- state ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def set_adapter(self, adapter: str | None) -> None:
        compute = self.head.base.weight.dtype
        fresh = [projection.load(adapter, self.dtype) for layer in self.projections for projection in layer.values()]
        fresh.append(self.head.load(adapter, compute))
        if any(fresh):
            self._drop_graphs()

    def _drop_graphs(self) -> None:
        """Forgets the captured graphs (each frees its own memory pool)."""
        self._graphs.clear()

    @torch.inference_mode()
    def reserve(self, slots: int, columns: int) -> None:
        """Room for ``slots`` rows of ``columns`` positions, grown to power-of-two sizes (contents kept)."""
        slots, columns = bucket(slots, 8), bucket(columns, MIN_COLUMNS)
        if slots <= self.slots and columns <= self.columns:
            return
        slots, columns = max(slots, self.slots), max(columns, self.columns)
        shape = (slots, self.kv_heads, columns, self.head_dim)
        keys, values = [], []
        for old_k, old_v in zip(self.keys or [None] * len(self.layers), self.values or [None] * len(self.layers)):
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if old_k is not None:
                k[: self.slots, :, : self.columns] = old_k
                v[: self.slots, :, : self.columns] = old_v
            keys.append(k)
            values.append(v)
        self.keys, self.values = keys, values
        tokens = torch.zeros((slots,), dtype=torch.long, device=self.device)
        positions = torch.zeros((slots,), dtype=torch.long, device=self.device)
        tokens[: self.slots], positions[: self.slots] = self.tokens, self.positions
        self.tokens, self.positions = tokens, positions
        self.slots, self.columns = slots, columns
        ids = torch.arange(columns, device=self.device)
        cos, sin = self.rotary(self.embed.weight[:1][None], ids[None])
        self._cos, self._sin, self._column_ids = cos[0], sin[0], ids
        self._drop_graphs()

    @torch.inference_mode()
    def write_prompts(self, start: int, layers: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor,
                      positions: torch.Tensor) -> None:
        """Rows ``start..`` take a prefill's left-padded keys and values (``mask`` [rows, width]) moved to
        column = position; ``positions`` is each row's next position."""
        rows, width = mask.shape
        lengths = mask.sum(dim=1)
        source = (torch.arange(width, device=self.device)[None] + (width - lengths)[:, None]).clamp(max=width - 1)
        index = source[:, None, :, None].expand(rows, self.kv_heads, width, self.head_dim)
        for (keys, values), k, v in zip(layers, self.keys, self.values):
            k[start : start + rows, :, :width] = keys.gather(2, index)
            v[start : start + rows, :, :width] = values.gather(2, index)
        self.positions[start : start + rows] = positions

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
        width, columns = bucket(rows), bucket(last_position + 1, MIN_COLUMNS)
        if width > self.slots or columns > self.columns:
            raise ValueError(f"static decode: {rows} rows at position {last_position} exceed the reserved "
                             f"{self.slots} × {self.columns}")
        if not self.use_graphs:
            return self._forward(width, columns)[:rows]
        graph = self._graphs.get((width, columns))
        if graph is None:
            try:
                graph = self._graphs[(width, columns)] = self._capture(width, columns)
            except RuntimeError as error:  # an op this torch cannot capture: decode eagerly, and say so once
                self.graph_error = f"{type(error).__name__}: {error}"
                warnings.warn(f"static decode: CUDA graph capture failed ({error}); decoding without graphs",
                              RuntimeWarning, stacklevel=2)
                self.use_graphs = False
                return self._forward(width, columns)[:rows]
        graph[0].replay()
        return graph[1][:rows]

    def _capture(self, rows: int, columns: int) -> tuple[Any, torch.Tensor]:
        # The warm-up and the capture write this step's keys into the cache, as the replay then does again.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(rows, columns)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        # Each graph gets its own memory pool (a few logit rows' worth): a pool shared between graphs must
        # outlive them all, and a capture into the handle of one whose graphs were dropped trips the caching
        # allocator's assertion.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._forward(rows, columns)
        return graph, logits

    def _forward(self, rows: int, columns: int) -> torch.Tensor:
        tokens, positions = self.tokens[:rows], self.positions[:rows]
        cos, sin = self._cos[positions][:, None], self._sin[positions][:, None]  # [rows, 1, dim]
        hidden = (self._column_ids[:columns][None] > positions[:, None])[:, None, None]  # [rows, 1, 1, columns]
        slot = positions.view(rows, 1, 1, 1).expand(rows, self.kv_heads, 1, self.head_dim)
        group = self.heads // self.kv_heads
        x = self.embed(tokens)
        for layer, projections, keys, values in zip(self.layers, self.projections, self.keys, self.values):
            attention = layer.self_attn
            q, k, v = projections["qkv"](_rms_norm(layer.input_layernorm, x))
            q = q.view(rows, self.heads, self.head_dim)
            k = k.view(rows, self.kv_heads, self.head_dim)
            v = v.view(rows, self.kv_heads, self.head_dim)
            if hasattr(attention, "q_norm"):
                q, k = _rms_norm(attention.q_norm, q), _rms_norm(attention.k_norm, k)
            qk = _rotate(torch.cat((q, k), dim=1), cos, sin)  # one rotation for both
            q, k = qk[:, : self.heads], qk[:, self.heads :]
            keys[:rows].scatter_(2, slot, k[:, :, None])
            values[:rows].scatter_(2, slot, v[:, :, None])
            scores = torch.matmul(q.view(rows, self.kv_heads, group, self.head_dim),
                                  keys[:rows, :, :columns].transpose(-1, -2)).float() * self.scale
            weights = torch.softmax(scores.masked_fill(hidden, _MASKED), dim=-1).to(v.dtype)
            out = torch.matmul(weights, values[:rows, :, :columns])  # [rows, kv heads, group, dim]
            x = projections["o_proj"](out.reshape(rows, self.heads * self.head_dim), residual=x)
            gate, up = projections["gate_up"](_rms_norm(layer.post_attention_layernorm, x))
            x = projections["down_proj"](layer.mlp.act_fn(gate) * up, residual=x)
        return self.head(_rms_norm(self.norm, x)).float()  # no final soft cap: such models are not taken
