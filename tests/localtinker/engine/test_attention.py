"""The engine's attention: bf16 products with a float32 softmax, sdpa's masks, sdpa in float32 beyond them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations import sdpa_attention

import localtinker.engine.attention as attention
from localtinker.engine.attention import NAME, engine_attention, product_attention, use_engine_attention
from localtinker.engine.models import tiny_random_dir
from localtinker.engine.portable_attention import portable_attention

HEADS, KEY_HEADS, DIM = 6, 2, 16


def _tiny(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_random_dir(), dtype=dtype).eval()


def _leaves(batch: int, queries: int, keys: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    shapes = ((batch, HEADS, queries, DIM), (batch, KEY_HEADS, keys, DIM), (batch, KEY_HEADS, keys, DIM))
    return tuple((2 * torch.randn(*s, generator=generator)).bfloat16().requires_grad_(True) for s in shapes)


def _float64_sdpa(query, key, value, mask=None, causal=False):
    """sdpa in float64 on the same bf16 inputs: the exact function."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=0.3, enable_gqa=True)
    return out.transpose(1, 2), (q, k, v)


def _module() -> torch.nn.Module:
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = HEADS // KEY_HEADS, True
    return module


def _assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within what bf16 products allow: ≤ 2% of the largest magnitude anywhere, ≤ 0.3% of it on average.
    (Float32 attention rounded to bf16 reads ~0.1% on average; a wrong mask or scale reads ≥ 10%.)"""
    error, scale = (got.double() - want).abs(), want.abs().max().item()
    assert error.max().item() <= 0.02 * scale and error.mean().item() <= 0.003 * scale, (error.max(), error.mean(), scale)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("masked", [False, True])
def test_bf16_products_match_exact_attention_to_bf16_rounding(masked, seed):
    query, key, value = _leaves(3, 9, 9, seed)
    mask = None
    if masked:  # left padding of 0, 2 and 4 tokens under a causal mask
        mask = torch.ones((9, 9), dtype=torch.bool).tril().repeat(3, 1, 1, 1)
        for row, pad in enumerate((0, 2, 4)):
            mask[row, :, :, :pad] = False
    out = product_attention(query, key, value, mask, 0.3, causal=not masked)
    exact, leaves = _float64_sdpa(query, key, value, mask, causal=not masked)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 9, HEADS, DIM)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    if mask is not None:  # rows that see no key (padding) are compared nowhere, and send no gradient
        sees = mask[:, 0].any(-1)[:, :, None, None]  # [batch, queries, 1, 1]
        upstream = upstream * sees
        out, exact = out * sees, exact * sees
    _assert_bf16_close(out, exact)
    grads = torch.autograd.grad(out, (query, key, value), upstream)
    exact_grads = torch.autograd.grad(exact, leaves, upstream.double())
    for got, want in zip(grads, exact_grads):
        assert got.dtype == torch.bfloat16
        _assert_bf16_close(got, want)


def test_a_row_that_sees_no_key_gets_finite_output():
    """Left padding: a padding query sees no key. NaN there would reach the real rows through v (0 × NaN)."""
    query, key, value = _leaves(1, 4, 4)
    mask = torch.ones((1, 1, 4, 4), dtype=torch.bool).tril()
    mask[..., :2] = False  # queries 0 and 1 see nothing
    out = product_attention(query, key, value, mask, 0.3, causal=False)
    assert torch.isfinite(out).all()


def test_causal_queries_after_cached_keys_see_only_the_first_keys():
    """sdpa's is_causal aligns query i with key i: transformers drops the keys past the queries."""
    query, key, value = _leaves(2, 5, 8)
    out = product_attention(query, key, value, None, 0.3, causal=True)
    exact, _ = _float64_sdpa(query, key[:, :, :5], value[:, :, :5], causal=True)
    _assert_bf16_close(out, exact)


def test_routing_bf16_products_within_the_bound_sdpa_in_float32_beyond(monkeypatch):
    calls = []

    def recording(module, q, k, v, mask, **kwargs):
        calls.append(q.dtype)
        return q.transpose(1, 2), None

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", recording)
    query, key, value = _leaves(2, 8, 8)
    engine_attention(_module(), query, key, value, None, scaling=0.3)
    assert calls == []  # bf16 products
    engine_attention(_module(), query.float(), key.float(), value.float(), None, scaling=0.3)
    engine_attention(_module(), query, key, value, None, scaling=0.3, sliding_window=4)
    engine_attention(_module(), query, key, value, torch.zeros(2, 1, 8, 8), scaling=0.3)  # an additive mask
    monkeypatch.setattr(attention, "MAX_SCORES", 2 * HEADS * 8 * 8 - 1)
    engine_attention(_module(), query, key, value, None, scaling=0.3)
    assert calls == [torch.float32] * 4


def test_left_padding_is_masked_as_with_sdpa():
    model = _tiny(torch.bfloat16)
    use_engine_attention(model)
    assert model.config._attn_implementation == NAME
    tokens = torch.randint(0, model.config.vocab_size, (1, 9))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), tokens], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        alone = model(input_ids=tokens).logits[0]
        behind_padding = model(input_ids=padded, attention_mask=mask, position_ids=positions).logits[0, 4:]
    assert alone.dtype == torch.bfloat16
    torch.testing.assert_close(behind_padding, alone, rtol=0, atol=0.05)  # unmasked: off by 0.6


def test_gradients_flow_through_the_engine_attention():
    model = _tiny(torch.bfloat16)
    use_engine_attention(model)
    embeddings = model.get_input_embeddings()(torch.randint(0, model.config.vocab_size, (2, 6))).detach()
    embeddings.requires_grad_(True)
    model(inputs_embeds=embeddings).logits.float().logsumexp(-1).sum().backward()
    assert embeddings.grad is not None and embeddings.grad.dtype == torch.bfloat16
    assert bool(embeddings.grad.abs().sum() > 0)


@pytest.mark.parametrize("attend", [engine_attention, portable_attention])
def test_attention_sinks_and_soft_caps_take_transformers_eager_formulas(attend):
    """gpt-oss's sinks (a logit per head that takes a share of every row's softmax and no value) and Gemma 2's
    soft cap, which no sdpa applies: both attentions compute transformers' own eager functions, in float32,
    under a causal mask given as sdpa's boolean mask (eager's is additive)."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    query, key, value = (t.detach().float() for t in _leaves(2, 7, 7))
    visible = torch.ones(7, 7, dtype=torch.bool).tril()[None, None].expand(2, 1, 7, 7)
    additive = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    module = _module()
    module.training = False
    module.sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(3)) * 2
    expected, _ = gpt_oss_eager(module, query, key, value, additive, scaling=0.3)
    out, _ = attend(module, query, key, value, visible, scaling=0.3, s_aux=module.sinks)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    plain, _ = attend(module, query, key, value, visible, scaling=0.3)
    assert (plain - expected).abs().max() > 1e-2  # the sinks matter at these sizes
    module.config = type("Config", (), {"attn_logit_softcapping": 5.0})()
    expected, _ = gemma2_eager(module, query, key, value, additive, scaling=0.3, softcap=5.0)
    out, _ = attend(module, query, key, value, visible, scaling=0.3, softcap=5.0)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


def test_sinks_through_sdpa_equal_the_explicit_product():
    """portable_attention.sink_attention (the sink as one more key, through sdpa: no scores kept for the backward)
    computes what the explicit product does, values and gradients, under a causal mask, sdpa's boolean mask with
    rows at different offsets (keys before the queries), an additive mask, and grouped key heads."""
    from localtinker.engine.portable_attention import explicit_attention, sink_attention

    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(4)) * 2
    for queries, keys in ((7, 7), (3, 9)):
        visible = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)[None, None].expand(2, 1, -1, -1)
        visible = visible.clone()
        visible[1, :, :, :2] = False  # the second row's first keys are padding
        additive = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
        for mask in (None, visible, additive):
            leaves = [t.detach().float().requires_grad_(True) for t in _leaves(2, queries, keys)]
            outputs = []
            for attend in (sink_attention, explicit_attention):
                out = attend(*leaves, mask if mask is not None or queries == keys else visible, 0.3, sinks=sinks)
                (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
                outputs.append((out.detach(), *(t.grad.clone() for t in leaves)))
                for t in leaves:
                    t.grad = None
            for ours, theirs in zip(*outputs):
                torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)  # float32, other kernels
