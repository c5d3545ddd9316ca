"""A bf16 model's attention in float32: same masks as sdpa, closer to the float32 model, bf16 outside."""

from __future__ import annotations

import torch

from localtinker.engine.float32_attention import NAME, decode_attention, use_float32_attention
from localtinker.engine.models import tiny_random_dir


def _tiny(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_random_dir(), dtype=dtype).eval()


def test_left_padding_is_masked_as_with_sdpa():
    model = _tiny(torch.bfloat16)
    use_float32_attention(model)
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


def test_gradients_flow_through_the_float32_attention():
    model = _tiny(torch.bfloat16)
    use_float32_attention(model)
    embeddings = model.get_input_embeddings()(torch.randint(0, model.config.vocab_size, (2, 6))).detach()
    embeddings.requires_grad_(True)
    model(inputs_embeds=embeddings).logits.float().logsumexp(-1).sum().backward()
    assert embeddings.grad is not None and embeddings.grad.dtype == torch.bfloat16
    assert bool(embeddings.grad.abs().sum() > 0)


def test_decode_attention_is_float32_sdpa_with_grouped_heads_and_masks():
    generator = torch.Generator().manual_seed(0)
    rows, query_heads, key_heads, keys, dim = 5, 6, 2, 11, 8
    query = torch.randn(rows, query_heads, 1, dim, generator=generator).to(torch.bfloat16)
    key = torch.randn(rows, key_heads, keys, dim, generator=generator).to(torch.bfloat16)
    value = torch.randn(rows, key_heads, keys, dim, generator=generator).to(torch.bfloat16)
    mask = torch.rand(rows, 1, 1, keys, generator=generator) > 0.3
    mask[..., -1] = True  # a row always sees its own token
    for scaling, row_mask in ((None, mask), (0.3, mask), (None, None)):
        expected = torch.nn.functional.scaled_dot_product_attention(
            query.float(), key.float().repeat_interleave(3, dim=1), value.float().repeat_interleave(3, dim=1),
            attn_mask=row_mask, scale=scaling,
        ).transpose(1, 2)
        got = decode_attention(query, key, value, row_mask, scaling)
        assert got.shape == (rows, 1, query_heads, dim) and got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_decode_steps_take_the_decode_path_and_match_a_full_forward(monkeypatch):
    import localtinker.engine.float32_attention as float32_attention
    from transformers import DynamicCache

    model = _tiny(torch.bfloat16)
    use_float32_attention(model)
    calls = []
    real = float32_attention.decode_attention
    monkeypatch.setattr(float32_attention, "decode_attention", lambda *args: calls.append(1) or real(*args))
    tokens = torch.randint(0, model.config.vocab_size, (3, 7))
    mask = torch.ones_like(tokens)
    mask[0, :2] = 0  # one row left-padded
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        full = model(input_ids=tokens, attention_mask=mask, position_ids=positions).logits[:, -1]
        cache = DynamicCache()
        model(input_ids=tokens[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1], past_key_values=cache)
        assert not calls  # a prefill is not a decode step
        step = model(input_ids=tokens[:, -1:], attention_mask=mask, position_ids=positions[:, -1:], past_key_values=cache).logits[:, -1]
    assert calls  # every layer of the step
    torch.testing.assert_close(step.float(), full.float(), rtol=0, atol=0.05)  # bf16 activations either way
