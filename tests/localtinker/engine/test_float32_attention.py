"""A bf16 model's attention in float32: same masks as sdpa, closer to the float32 model, bf16 outside."""

from __future__ import annotations

import torch

from localtinker.engine.float32_attention import NAME, use_float32_attention
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
