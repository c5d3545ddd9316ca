"""Causal attention of packed rows beyond what the flash kernel computes: attention sinks (gpt-oss) and soft caps
on the scores (Gemma 2), with a flash kernel's memory: nothing of [queries × keys] is kept for the backward.

**Sinks**, through the flash kernel on a GPU. A sink is a learned logit per head that joins every row's softmax as
one more column and then is dropped, so a row's weights over its keys sum to ``σ = sigmoid(lse − sink)``, where
``lse`` is the log-normaliser of its scores over the keys alone. The attention with sinks is therefore the plain
attention ``O`` times ``σ``, and the flash kernel returns both ``O`` and ``lse``. torch's own varlen wrapper drops
the gradient that reaches ``lse``, so the backward is written here, for the kernel's backward to compute with the
right inputs:

- the gradient of ``o = σ·O`` with respect to a score ``S_i`` is ``p_i·(σ g·v_i − σ² g·O)``, with ``p_i`` the
  softmax over the keys alone;
- the kernel's backward computes ``p_i·(dO·v_i − D)`` with ``D = Σ dO∘out`` from the ``dO`` and ``out`` it is
  given: handed ``dO = σ·g`` and ``out = o = σ·O`` it computes exactly that gradient, so one kernel call does it;
- a sink's own gradient is ``−Σ g·o·(1 − σ)`` over its head's rows (nothing trains it in a LoRA run, but a full
  fine-tune would).

**Soft caps** (``cap·tanh(s / cap)`` on each score) change every score, which no correction after the kernel can
give, so they run on explicit kernels: float32 products segment by segment (a shared prompt's segments included),
the scores recomputed in the backward as the flash kernel recomputes them. Through transformers' layers a packed
micro-batch's capped scores were one [heads × tokens × tokens] float32 product kept for the backward in every layer
(Gemma-2-2B at its 4096-token budget: 0.5 GiB a layer, several times over).

This lets gpt-oss and Gemma 2 train through the written-out layers (packed_layers.py: a prompt shared by several
samples runs once). The explicit kernels compute what the flash kernel's forward and backward compute (the
log-normaliser; the gradient from the given ``dO`` and ``out``), so on the CPU the same autograd function checks
this backward, and the GPU test the kernel.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from localtinker.engine.packed_layout import segment_visibility

if TYPE_CHECKING:
    from localtinker.engine.packed_layout import PackedLayout


def attention_beyond_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, scaling: float,
                           window: int | None, sinks: torch.Tensor | None, softcap: float | None,
                           flash: bool) -> torch.Tensor:
    """Causal attention of q [tokens, heads, d] over k, v [key rows, kv heads, d] already in ``layout``'s key
    order, by its segments (aligned at the keys' end, a sliding ``window`` as in
    portable_attention.packed_causal_attention), with ``sinks`` [heads] and/or a ``softcap`` on the scores;
    returns [tokens, heads, d]. ``flash``: the CUDA flash kernel (bf16/fp16) where no soft cap asks for the
    explicit kernels; a flash kernel this torch cannot call as asked warns once and leaves the explicit kernels for
    the process (the same values, slower)."""
    global _flash_error
    if flash and softcap is None and _flash_error is None:
        try:
            return _BeyondFlash.apply(q, k, v, sinks, layout, scaling, window, None, True)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError) as error:  # (an op's arguments this torch's schema lacks: either)
            _flash_error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            warnings.warn(f"attention sinks: the flash kernel failed ({_flash_error}); computing them explicitly",
                          RuntimeWarning, stacklevel=2)
    return _BeyondFlash.apply(q, k, v, sinks, layout, scaling, window, softcap, False)


_flash_error: str | None = None  # why the flash kernel was given up in this process, if it was


class _BeyondFlash(torch.autograd.Function):
    """The kernels' attention, times each row's share ``σ`` where there are sinks (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                layout: PackedLayout, scaling: float, window: int | None, softcap: float | None,
                flash: bool) -> torch.Tensor:
        kernels = _Flash(layout, scaling, window) if flash else _Explicit(layout, scaling, window, softcap)
        out, lse = kernels.forward(q, k, v)
        share = None
        if sinks is not None:
            share = torch.sigmoid(lse - sinks.float()[:, None]).t()[..., None]  # σ [tokens, heads, 1]
            out = (out.float() * share).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, share)
        ctx.kernels, ctx.sinks_dtype = kernels, None if sinks is None else sinks.dtype
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, o, lse, share = ctx.saved_tensors
        d_out = g if share is None else (g.float() * share).to(q.dtype)
        dq, dk, dv = ctx.kernels.backward(d_out, q, k, v, o, lse)
        d_sinks = None
        if ctx.needs_input_grad[3]:
            d_sinks = -((g.float() * o.float()).sum(-1) * (1 - share[..., 0])).sum(0).to(ctx.sinks_dtype)
        return dq, dk, dv, d_sinks, None, None, None, None, None


class _Flash:
    """torch's flash kernel over the packed segments (what ``torch.nn.attention.varlen`` calls), keeping the
    log-normaliser ``lse`` [heads, tokens] and the kernel's own state for its backward."""

    def __init__(self, layout: PackedLayout, scaling: float, window: int | None) -> None:
        self.layout, self.scaling = layout, scaling
        # causal as varlen_attn asks for it; a window: the keys after position − window and none ahead
        self.causal = not window
        self.window = (window - 1 if window else -1, 0)
        self.state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _bounds(self) -> tuple:
        layout = self.layout
        return layout.cu_q, layout.cu_k, layout.max_q, layout.max_k

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, *self._bounds(), 0.0, self.causal, False, scale=self.scaling, window_size_left=self.window[0],
            window_size_right=self.window[1])
        self.state = rng_state, unused, lse  # the kernel's backward takes its log-normaliser as it gave it
        return out, self._by_token(lse, q.shape[0])

    def _by_token(self, lse: torch.Tensor, tokens: int) -> torch.Tensor:
        """The log-normaliser as [heads, tokens]: how recent kernels give it for packed rows; older ones padded
        it per segment, [segments, heads, longest]."""
        if lse.dim() == 2:
            return lse
        lengths = torch.tensor(self.layout.q_lengths, device=lse.device)
        segment = torch.repeat_interleave(torch.arange(len(lengths), device=lse.device), lengths)
        offset = torch.arange(tokens, device=lse.device) - self.layout.cu_q[:-1].long()[segment]
        return lse[segment, :, offset].t()

    def backward(self, d_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rng_state, unused, kernel_lse = self.state
        return torch.ops.aten._flash_attention_backward(
            d_out.contiguous(), q, k, v, out, kernel_lse, *self._bounds(), 0.0, self.causal, rng_state, unused,
            scale=self.scaling, window_size_left=self.window[0], window_size_right=self.window[1])


class _Explicit:
    """The flash kernel's forward and backward as float32 products, segment by segment, with a soft cap on the
    scores where asked: what a CPU runs, and a GPU for soft caps."""

    def __init__(self, layout: PackedLayout, scaling: float, window: int | None, softcap: float | None = None) -> None:
        self.layout, self.scaling, self.window, self.softcap = layout, scaling, window, softcap

    def _segments(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Per segment: its query rows, and its queries, keys and values ``[heads, rows, d]`` in float32 (keys
        and values expanded to the query heads), its scores' visibility and its key rows."""
        group = q.shape[1] // k.shape[1]
        q_start = k_start = 0
        for q_length, k_length in zip(self.layout.q_lengths, self.layout.k_lengths):
            rows, key_rows = slice(q_start, q_start + q_length), slice(k_start, k_start + k_length)
            q_start, k_start = q_start + q_length, k_start + k_length
            visible = segment_visibility(q_length, k_length, self.window, q.device)
            yield (rows, key_rows, visible,
                   *(t.float().transpose(0, 1).repeat_interleave(n, 0) for t, n in ((q[rows], 1), (k[key_rows], group),
                                                                                   (v[key_rows], group))))

    def _scores(self, queries: torch.Tensor, keys: torch.Tensor,
                visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The masked scores, and with a soft cap the derivative of each capped score by the plain one."""
        scores = torch.matmul(queries, keys.transpose(-1, -2)) * self.scaling
        slope = None
        if self.softcap:
            capped = torch.tanh(scores / self.softcap)
            scores, slope = capped * self.softcap, 1 - capped.square()
        return scores.masked_fill(~visible, float("-inf")), slope

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        outs, lses = [], []
        for _, _, visible, queries, keys, values in self._segments(q, k, v):
            scores, _ = self._scores(queries, keys, visible)
            lse = torch.logsumexp(scores, -1)
            outs.append(torch.matmul(torch.exp(scores - lse[..., None]), values).transpose(0, 1))
            lses.append(lse)
        return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1)

    def backward(self, d_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
        heads, key_heads = q.shape[1], k.shape[1]
        for rows, key_rows, visible, queries, keys, values in self._segments(q, k, v):
            scores, slope = self._scores(queries, keys, visible)
            weights = torch.exp(scores - lse[:, rows, None])  # p [heads, q, k]
            grad = d_out[rows].float().transpose(0, 1)  # dO [heads, q, d]
            d_weights = torch.matmul(grad, values.transpose(-1, -2))
            # D = Σ dO∘out from the out given, as the kernel computes it
            d_scores = weights * (d_weights - (grad * out[rows].float().transpose(0, 1)).sum(-1, keepdim=True))
            if slope is not None:  # through the cap to the plain scores
                d_scores = d_scores * slope
            dq[rows] = (torch.matmul(d_scores, keys) * self.scaling).transpose(0, 1)
            per_head_k = torch.matmul(d_scores.transpose(-1, -2), queries) * self.scaling
            per_head_v = torch.matmul(weights.transpose(-1, -2), grad)
            for target, per_head in ((dk, per_head_k), (dv, per_head_v)):  # the group's heads summed per kv head
                summed = per_head.reshape(key_heads, heads // key_heads, *per_head.shape[1:]).sum(1)
                target[key_rows] += summed.transpose(0, 1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
