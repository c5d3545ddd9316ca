"""The unembedding of a bf16-compute model: bulk logits in bf16, the few that carry the mass in float32.

On a CPU with native bf16 (bf16_matmul.py) the float32 unembedding was the largest single cost left,
and bf16 runs it faster (docs/engine-notes.md, precision). But
bf16 logits are rounded to ~0.06 at typical magnitudes, and the log-sum-exp is dominated by the top
few tokens, so bf16 logits alone shift every logprob by a few hundredths.

So :class:`Bf16Head` computes all logits in bf16 (packed weights where oneDNN is faster), and
:func:`exact_logits_at` recomputes the ``REFINED_TOKENS`` largest of each row exactly in float32 from
the float32 master weight (plus the LoRA delta of a peft-wrapped head): a [rows × K × hidden] gather
and a row-wise product, a few % of the bulk product. logprobs.py combines the two — the same function of
the hidden state in the trainer and the sampler. Tokens outside a row's top K keep their bf16 logits:
their share of the probability mass is small, so the rounding moves a log-sum-exp by thousandths, but a
low-probability token's own logprob carries its logit's rounding (≤ half a bf16 ulp).
"""

from __future__ import annotations

from typing import Any

import torch

from localtinker.engine.packed_linear import PackedFrozenLinear, pack_weight, packed_linear, packing_available
from localtinker.engine.packed_training import forward_and_gradient_pack_wins

# Per row, this many of the largest bf16 logits are recomputed in float32. On SmolLM2 the top 32 tokens
# hold nearly all the probability mass of a chat continuation, and the recomputation is cheap next to
# the bulk product; the selection (a top-k pass over the vocabulary) costs the same for any small K.
REFINED_TOKENS = 32


class Bf16Head(torch.nn.Linear):
    """An ``nn.Linear`` (so peft can put LoRA on it) with a float32 master ``weight`` whose forward
    returns bf16 logits from a bf16 copy of it, packed for oneDNN where that measures faster.

    The copies are plain attributes, not buffers: they never reach a state dict or checkpoint. The
    master weight serves :func:`exact_logits_at` and anything that reads ``weight``.
    """

    packs_itself = True  # packed_linear.pack_by_shape leaves this layer alone

    def prepare(self, pack: bool | None = None) -> None:
        """Makes the bf16 copies (once, after the master weight is set): packed where ``pack``, or where
        oneDNN measures faster when it is None."""
        weight = self.weight.detach().to(torch.bfloat16)
        self._packed: tuple[torch.Tensor, torch.Tensor] | None = None
        self._bf16_weight: torch.Tensor | None = weight
        if pack is None:
            pack = packing_available(torch.bfloat16) and forward_and_gradient_pack_wins(weight)
        if pack:
            self._packed = (pack_weight(weight), pack_weight(weight.t().contiguous()))
            self._bf16_weight = None
        self._bf16_bias = None if self.bias is None else self.bias.detach().to(torch.bfloat16)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.to(torch.bfloat16)
        if self._packed is None:
            return torch.nn.functional.linear(rows, self._bf16_weight, self._bf16_bias)
        packed, packed_t = self._packed
        if torch.is_grad_enabled() and rows.requires_grad:
            return PackedFrozenLinear.apply(rows, packed, packed_t, self._bf16_bias)
        return packed_linear(rows, packed, self._bf16_bias)


def refines_logits(lm_head: torch.nn.Module) -> bool:
    """True when ``lm_head`` (possibly peft-wrapped) is a :class:`Bf16Head`."""
    return isinstance(getattr(lm_head, "base_layer", lm_head), Bf16Head)


def exact_logits_at(hidden: torch.Tensor, lm_head: torch.nn.Module, columns: torch.Tensor) -> torch.Tensor:
    """float32 logits of ``hidden`` [rows × hidden] at ``columns`` [rows × K] (token ids per row), from the
    float32 master weight and the LoRA factors of a peft-wrapped head; differentiable in ``hidden`` and
    the factors. Products and sums are elementwise along each row (not a GEMM, whose kernel choice depends
    on the row count), so a row's refined values never depend on its neighbours. (The bulk bf16 product is
    batch-invariant too, packed or not; an unmerged LoRA's low-rank add into it is not always: its small
    GEMM sums a lone row in another order, which changed a bf16 output bit in 5 of 234 random 7-row draws
    on a tiny head, and float32 samplers avoid it only by merging.)"""
    base = getattr(lm_head, "base_layer", lm_head)
    rows = hidden.float()
    exact = _row_dot(_gathered_rows(base.weight.detach(), columns), rows)
    if base.bias is not None:
        exact = exact + base.bias.detach()[columns]
    for factor_a, factor_b, scale in _lora_terms(lm_head):
        low_rank = _row_dot(factor_a.expand(len(rows), *factor_a.shape), rows)  # [rows × rank]
        exact = exact + _row_dot(factor_b[columns], low_rank) * scale
    return exact


def _gathered_rows(weight: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``weight[columns]`` [rows × K × d] through ``index_select``: the same rows, several times faster than
    advanced indexing on CPU."""
    return weight.index_select(0, columns.reshape(-1)).view(*columns.shape, weight.shape[-1])


def _row_dot(matrices: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """[rows × K × d] · [rows × d] → [rows × K], reduced in the same order for any number of rows."""
    return (matrices * vectors[:, None, :]).sum(dim=-1)


def _lora_terms(layer: Any) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """(A, B, scaling) of each active adapter of a peft LoRA layer; [] for a plain layer."""
    if not hasattr(layer, "lora_A") or layer.disable_adapters:
        return []
    if layer.merged:
        raise RuntimeError("a merged LoRA unembedding cannot be refined: bf16 heads are never merged")
    terms = []
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        if name in getattr(layer, "lora_variant", {}) or not isinstance(layer.lora_dropout[name], torch.nn.Identity):
            raise RuntimeError(f"adapter {name!r}: only plain LoRA without dropout is supported on a bf16 head")
        terms.append((layer.lora_A[name].weight, layer.lora_B[name].weight, float(layer.scaling[name])))
    return terms
