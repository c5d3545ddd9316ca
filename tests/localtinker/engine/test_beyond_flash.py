"""beyond_flash.py: attention with gpt-oss's sinks and/or Gemma 2's soft cap over packed segments, with the
backward written out, equals transformers' eager formula (portable_attention.explicit_attention: a sink column, the
capped scores) and its autograd gradients — for the queries, keys, values and sinks, through shared prompts'
gathered keys and sliding windows — and keeps nothing of [queries × keys] for the backward. On the CPU the kernels
are the explicit ones, which compute what flash computes from the same inputs; test_cuda.py checks the flash
kernel itself."""

from __future__ import annotations

import pytest
import torch

from localtinker.engine.packed_layout import PackedLayout
from localtinker.engine.portable_attention import explicit_attention, packed_causal_attention

CPU = torch.device("cpu")
HEADS, KV_HEADS, DIM, SCALE = 4, 2, 16, 0.25


def shared_layout(device: torch.device) -> PackedLayout:
    """A prompt of 5 rows run once and read by two members of 3 rows each, then a datum of 6 rows alone: the
    members' queries are the last rows of their key segments (8 keys for 3 queries)."""
    prompt, first, second, alone = range(0, 5), range(5, 8), range(8, 11), range(11, 17)
    key_rows = [*prompt, *prompt, *first, *prompt, *second, *alone]
    return PackedLayout(torch.tensor([0, 5, 8, 11, 17], dtype=torch.int32, device=device),
                        torch.tensor([0, 5, 13, 21, 27], dtype=torch.int32, device=device), (5, 3, 3, 6), (5, 8, 8, 6),
                        torch.tensor(key_rows, device=device))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, scaling: float,
              window: int | None, sinks: torch.Tensor | None, softcap: float | None = None) -> torch.Tensor:
    """Segment by segment, transformers' eager formula: the capped scores, with one more column per head, the sink
    (the arguments of packed_causal_attention)."""
    if layout.key_rows is not None:
        k, v = k.index_select(0, layout.key_rows), v.index_select(0, layout.key_rows)
    outs, q_start, k_start = [], 0, 0
    for q_length, k_length in zip(layout.q_lengths, layout.k_lengths):
        visible = torch.ones((q_length, k_length), dtype=torch.bool, device=q.device).tril(k_length - q_length)
        if window:
            visible &= ~torch.ones_like(visible).tril(k_length - q_length - window)
        segment = (q[q_start:q_start + q_length], k[k_start:k_start + k_length], v[k_start:k_start + k_length])
        out = explicit_attention(*(t.transpose(0, 1)[None] for t in segment), visible[None, None], scaling, softcap,
                                 sinks)
        outs.append(out[0])
        q_start, k_start = q_start + q_length, k_start + k_length
    return torch.cat(outs)


def inputs(device: torch.device, dtype: torch.dtype, tokens: int = 17, seed: int = 0,
           dim: int = DIM) -> list[torch.Tensor]:
    """q, k, v and the sinks, the same for a device and dtype as for another (drawn on the CPU in float32)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(tokens, heads, dim, generator=generator) for heads in (HEADS, KV_HEADS, KV_HEADS)]
    sinks = torch.randn(HEADS, generator=generator) * 2  # sinks of gpt-oss's size take a real share of the softmax
    return [t.to(device, dtype).requires_grad_() for t in (*tensors, sinks)]


def values_and_gradients(attention, tensors: list[torch.Tensor], layout: PackedLayout, window: int | None,
                         softcap: float | None = None, sinks: bool = True) -> list[torch.Tensor]:
    """The output of ``attention`` (packed_causal_attention's arguments) and the gradients of q, k, v (and the
    sinks) of a weighted sum of it."""
    q, k, v, sink_logits = tensors
    out = attention(q, k, v, layout, SCALE, window, sink_logits if sinks else None, softcap)
    tensors = tensors if sinks else tensors[:3]
    weights = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
    grads = torch.autograd.grad((out.float() * weights).sum(), tensors)
    return [out.detach().float(), *(g.float() for g in grads)]


@pytest.mark.parametrize("softcap,sinks", [(None, True), (2.0, False), (2.0, True)],
                         ids=["sinks", "softcap", "sinks-and-softcap"])
@pytest.mark.parametrize("window", [None, 4], ids=["causal", "window"])
@pytest.mark.parametrize("shared", [False, True], ids=["rows", "shared-prompt"])
def test_attention_and_its_gradients_equal_the_eager_formula(shared, window, softcap, sinks):
    layout = shared_layout(CPU) if shared else PackedLayout.rows([7, 4, 6], CPU)
    tensors = inputs(CPU, torch.float32)
    ours = values_and_gradients(packed_causal_attention, tensors, layout, window, softcap, sinks)
    expected = values_and_gradients(reference, tensors, layout, window, softcap, sinks)
    for name, mine, theirs in zip(("out", "dq", "dk", "dv", "dsinks"), ours, expected):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5, msg=name)
    if sinks:
        assert expected[4].abs().min() > 1e-3  # the sinks' gradients are not trivially zero


def test_a_soft_cap_bends_the_scores_it_is_given():
    """The cap changes the attention (scores of ~±6 under a cap of 2), and a cap far above every score does not."""
    q, k, v, _ = inputs(CPU, torch.float32)
    layout = PackedLayout.rows([17], CPU)
    plain = packed_causal_attention(q, k, v, layout, SCALE)
    assert (packed_causal_attention(q, k, v, layout, SCALE, softcap=2.0) - plain).abs().max() > 0.1
    torch.testing.assert_close(packed_causal_attention(q, k, v, layout, SCALE, softcap=1e6), plain, atol=1e-5, rtol=0)


@pytest.mark.parametrize("softcap,sinks", [(None, True), (2.0, False)], ids=["sinks", "softcap"])
def test_nothing_of_queries_by_keys_is_kept_for_the_backward(softcap, sinks):
    """What autograd keeps of the attention of one 256-token segment: its inputs, output and log-normaliser, as a
    flash kernel keeps them, not the [heads × 256 × 256] scores (transformers' explicit product keeps those for the
    tanh and the softmax, in every layer)."""
    q, k, v, sink_logits = inputs(CPU, torch.float32, tokens=256)
    kept: list[int] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        kept.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        packed_causal_attention(q, k, v, PackedLayout.rows([256], CPU), SCALE, None, sink_logits if sinks else None,
                                softcap)
    assert kept and max(kept) <= 256 * HEADS * DIM
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        reference(q, k, v, PackedLayout.rows([256], CPU), SCALE, None, sink_logits if sinks else None, softcap)
    assert max(kept) >= HEADS * 256 * 256  # (the hooks see what a plain autograd graph keeps)


def test_a_sink_takes_its_share_of_every_row():
    """With a sink far above every score a row's weights vanish; far below, the attention is the plain one."""
    q, k, v, _ = inputs(CPU, torch.float32)
    layout = PackedLayout.rows([17], CPU)
    plain = packed_causal_attention(q, k, v, layout, SCALE)
    low = packed_causal_attention(q, k, v, layout, SCALE, sinks=torch.full((HEADS,), -1e4))
    high = packed_causal_attention(q, k, v, layout, SCALE, sinks=torch.full((HEADS,), 1e4))
    torch.testing.assert_close(low, plain, atol=1e-6, rtol=0)
    assert high.abs().max() < 1e-6


def test_a_flash_kernel_that_fails_as_called_leaves_the_explicit_kernels_with_a_warning(monkeypatch):
    """A torch whose flash op does not take these arguments: one warning naming why, the same values from the
    explicit kernels, and no second try in the process."""
    from localtinker.engine import beyond_flash

    calls = []

    def refuse(self, q, k, v):
        calls.append(1)
        raise RuntimeError("Overloaded torch operator invoked from Python failed to match any schema")

    monkeypatch.setattr(beyond_flash._Flash, "forward", refuse)
    monkeypatch.setattr(beyond_flash, "_flash_error", None)
    q, k, v, sinks = inputs(CPU, torch.float32)
    layout = PackedLayout.rows([7, 4, 6], CPU)
    expected = beyond_flash.attention_beyond_flash(q, k, v, layout, SCALE, None, sinks, None, flash=False)
    with pytest.warns(RuntimeWarning, match="flash kernel failed.*failed to match any schema"):
        out = beyond_flash.attention_beyond_flash(q, k, v, layout, SCALE, None, sinks, None, flash=True)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    beyond_flash.attention_beyond_flash(q, k, v, layout, SCALE, None, sinks, None, flash=True)
    assert calls == [1] and beyond_flash._flash_error.startswith("RuntimeError")


def test_a_log_normaliser_padded_per_segment_is_read_token_by_token():
    """An older flash kernel gives ``lse`` as [segments, heads, longest]; each packed token takes its segment's
    row at its offset in it (a recent one's [heads, tokens] passes through)."""
    from localtinker.engine.beyond_flash import _Flash

    layout = PackedLayout.rows([3, 5, 2], CPU)
    padded = torch.arange(3 * HEADS * 5, dtype=torch.float32).reshape(3, HEADS, 5)
    by_token = _Flash(layout, SCALE, None)._by_token(padded, 10)
    expected = torch.stack([padded[segment, :, offset] for segment, n in enumerate((3, 5, 2))
                            for offset in range(n)], 1)
    assert torch.equal(by_token, expected) and by_token.shape == (HEADS, 10)
    assert _Flash(layout, SCALE, None)._by_token(expected, 10) is expected
