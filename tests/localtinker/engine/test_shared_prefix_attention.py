"""The trainer's shared-prompt attention: the same function and gradients as attention over copied prompts."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations import sdpa_attention

from localtinker.engine.attention import engine_attention
from localtinker.engine.shared_prefix_attention import MemberLayout, SharedPrefixKV, shared_prefix_attention

KEY_HEADS, GROUP, DIM, PROMPT = 2, 3, 8, 7


def _inputs(sizes: list[int], own: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    members, groups = sum(sizes), len(sizes)

    def leaf(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_(True)

    query = leaf(members, KEY_HEADS * GROUP, own, DIM)
    prefix_keys, prefix_values = leaf(groups, KEY_HEADS, PROMPT, DIM), leaf(groups, KEY_HEADS, PROMPT, DIM)
    own_keys, own_values = leaf(members, KEY_HEADS, own, DIM), leaf(members, KEY_HEADS, own, DIM)
    mask = torch.ones((groups, PROMPT), dtype=torch.bool)
    for g in range(groups):
        mask[g, : g % 3] = False  # left padding of different widths
    kv = SharedPrefixKV(prefix_keys, prefix_values, mask, MemberLayout(tuple(sizes)), own_keys, own_values)
    return query, kv, (query, prefix_keys, prefix_values, own_keys, own_values)


def _copied_prompt_attention(query: torch.Tensor, kv: SharedPrefixKV) -> torch.Tensor:
    """Each member's prompt copied in, grouped-query heads expanded, one masked softmax: the plain formula."""
    keys, values = kv.dense()
    members, heads, own, _ = query.shape
    keys, values = (t.repeat_interleave(GROUP, dim=1) for t in (keys, values))
    visible = torch.cat(
        [kv.prefix_mask[kv.layout.member_group][:, None, :].expand(members, own, PROMPT),
         torch.ones((own, own), dtype=torch.bool).tril().expand(members, own, own)],
        dim=-1,
    )
    scores = (query @ keys.transpose(-1, -2)) * 0.25
    weights = scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1)
    return (weights @ values).transpose(1, 2)


@pytest.mark.parametrize("sizes", [[4, 4, 4], [2, 3, 2, 1, 3]])  # one batched product; several group sizes
def test_output_and_gradients_equal_attention_over_copied_prompts(sizes):
    query, kv, leaves = _inputs(sizes, own=5)
    shared = shared_prefix_attention(query, kv, 0.25)
    copied = _copied_prompt_attention(query, kv)
    assert shared.shape == (sum(sizes), 5, KEY_HEADS * GROUP, DIM)
    torch.testing.assert_close(shared, copied, rtol=0, atol=1e-5)
    upstream = torch.randn(shared.shape, generator=torch.Generator().manual_seed(1))
    for got, want in zip(torch.autograd.grad(shared, leaves, upstream), torch.autograd.grad(copied, leaves, upstream)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_bf16_model_multiplies_in_bf16_and_gets_bf16_back():
    """bf16 products with a float32 softmax, as the engine's dense attention (attention.py): the float32
    function of the same rounded inputs up to the products' rounding, and not closer."""
    query, kv, _ = _inputs([2, 2], own=3)
    rounded = [t.detach().bfloat16() for t in (kv.prefix_keys, kv.prefix_values, kv.own_keys, kv.own_values)]
    as_bf16 = SharedPrefixKV(*rounded[:2], kv.prefix_mask, kv.layout, *rounded[2:])
    out, _ = engine_attention(torch.nn.Module(), query.detach().bfloat16(), as_bf16, as_bf16, None, scaling=0.25)
    assert out.dtype == torch.bfloat16
    as_float32 = SharedPrefixKV(*(t.float() for t in rounded[:2]), kv.prefix_mask, kv.layout,
                                *(t.float() for t in rounded[2:]))
    exact = shared_prefix_attention(query.detach().bfloat16().float(), as_float32, 0.25)
    error, scale = (out.float() - exact).abs(), exact.abs().max()
    assert error.max() <= 0.02 * scale and error.mean() <= 0.003 * scale
    assert (shared_prefix_attention(query.detach().bfloat16(), as_bf16, 0.25) - exact).abs().max() > 1e-4 * scale


def test_an_option_it_does_not_implement_takes_the_copied_prompts(monkeypatch):
    """A set attention option (here a sliding window, which only sdpa's path applies) routes through ``dense()``."""
    query, kv, _ = _inputs([2, 2], own=3)
    members, own = query.shape[0], query.shape[2]
    visible = torch.cat(
        [kv.prefix_mask[kv.layout.member_group][:, None, :].expand(members, own, PROMPT),
         torch.ones((own, own), dtype=torch.bool).tril().expand(members, own, own)],
        dim=-1,
    )[:, None]
    calls = []

    def recording(module, q, k, v, mask, **kwargs):
        calls.append((k.shape, mask is visible))
        return q.transpose(1, 2), None

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", recording)
    engine_attention(torch.nn.Module(), query.detach(), kv, kv, visible, scaling=0.25, sliding_window=64)
    assert calls == [((members, KEY_HEADS, PROMPT + own, DIM), True)]
