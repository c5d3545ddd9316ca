"""chunked_logprobs.py: target logprobs and their gradients, a chunk of rows at a time through a function of the
unembedding's output whose backward writes the logits' gradient in one pass, equal autograd through the plain
float32 formula (``lm_head(h).float()``, soft cap, temperature, log-softmax, gather) — for the hidden states and
a trainable unembedding alike, eager and compiled (the CPU's compiler standing in for the GPU's)."""

from __future__ import annotations

import pytest
import torch

from localtinker.engine import chunked_logprobs, decode_layer
from localtinker.engine.chunked_logprobs import chunked_token_logprobs

ROWS, WIDTH, VOCAB = 23, 16, 301


def _plain(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, softcap: float | None,
           temperature: float) -> torch.Tensor:
    logits = head(hidden).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return (logits / temperature).log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


def _case(dtype: torch.dtype, seed: int = 0, device: torch.device | None = None, vocab: int = VOCAB,
          ) -> tuple[torch.Tensor, torch.nn.Linear, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn((ROWS, WIDTH), generator=generator).to(device=device, dtype=dtype)
    head = torch.nn.Linear(WIDTH, vocab, bias=False).to(device=device, dtype=dtype)
    with torch.no_grad():  # logits of a few units: the soft caps bite
        head.weight.copy_(torch.randn((vocab, WIDTH), generator=generator) * 2)
    targets = torch.randint(0, vocab, (ROWS,), generator=generator).to(device)
    weights = torch.randn((ROWS,), generator=generator).to(device=device, dtype=dtype)
    return hidden, head, targets, weights


def _values_and_grads(fn, hidden, head, targets, weights, softcap, temperature):
    hidden = hidden.clone().requires_grad_(True)
    head.weight.grad = None
    logprobs = fn(hidden, head, targets, softcap, temperature)
    (logprobs * weights).sum().backward()
    return logprobs.detach(), hidden.grad, head.weight.grad


def _ours(chunk: int):
    return lambda hidden, head, targets, softcap, temperature: chunked_token_logprobs(
        hidden, head, targets, softcap, temperature, chunk=chunk)


def compare_with_plain(softcap: float | None, temperature: float, chunks: tuple[int, ...] = (5, ROWS, 4096),
                       dtype: torch.dtype = torch.float32, device: torch.device | None = None, vocab: int = VOCAB,
                       atol: float = 1e-5, grad_tolerance: float = 1e-5) -> None:
    """Our logprobs and gradients (hidden states, unembedding) against autograd through the plain formula, for
    each chunk size (several chunks, one exactly, one larger than the rows)."""
    case = _case(dtype, device=device, vocab=vocab)
    expected = _values_and_grads(_plain, *case, softcap, temperature)
    for chunk in chunks:
        ours = _values_and_grads(_ours(chunk), *case, softcap, temperature)
        torch.testing.assert_close(ours[0], expected[0], atol=atol, rtol=0, msg=f"logprobs, chunk {chunk}")
        for a, b, name in zip(ours[1:], expected[1:], ("hidden grad", "unembedding grad")):
            torch.testing.assert_close(a.float(), b.float(), atol=grad_tolerance, rtol=grad_tolerance,
                                       msg=f"{name}, chunk {chunk}")


@pytest.mark.parametrize("softcap, temperature", [(None, 1.0), (None, 0.7), (2.5, 1.0), (2.5, 1.3)])
def test_logprobs_and_gradients_equal_autograd_through_the_plain_formula(softcap, temperature):
    compare_with_plain(softcap, temperature)


def test_bf16_logits_keep_their_dtype_and_agree_with_float32_arithmetic():
    """A bf16 model's logits stay bf16 (their gradient too, which the unembedding's backward takes), while
    the log-softmax runs in float32: values equal the float32 formula on the same bf16 logits."""
    hidden, head, targets, weights = _case(torch.bfloat16)
    seen = {}

    def record(module, grad_in, grad_out) -> None:
        seen["dtype"] = grad_out[0].dtype

    head.register_full_backward_hook(record)
    ours = _values_and_grads(_ours(7), hidden, head, targets, weights.bfloat16(), None, 1.0)
    expected = _values_and_grads(_plain, hidden, head, targets, weights.bfloat16(), None, 1.0)
    assert ours[0].dtype == torch.float32 and seen["dtype"] == torch.bfloat16
    torch.testing.assert_close(ours[0], expected[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours[1].float(), expected[1].float(), atol=0.05, rtol=0.02)


def test_without_autograd_the_logprobs_are_the_same():
    hidden, head, targets, _ = _case(torch.float32, seed=3)
    with torch.no_grad():
        expected = _plain(hidden, head, targets, 2.0, 0.9)
        ours = chunked_token_logprobs(hidden, head, targets, 2.0, 0.9, chunk=6)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


def test_compiled_functions_compute_what_the_eager_ones_do(monkeypatch):
    """On a GPU both functions go through torch.compile (one pass each over bf16 logits there); the CPU's
    compiler traces the same functions here, with a soft cap and a temperature, over two row counts."""
    cpu = torch.device("cpu")
    monkeypatch.setitem(chunked_logprobs._compile_on, cpu, True)
    case = _case(torch.float32, seed=5)
    expected = _values_and_grads(_plain, *case, 2.5, 1.3)
    ours = _values_and_grads(_ours(9), *case, 2.5, 1.3)  # chunks of 9, 9 and 5 rows
    assert all(fn in decode_layer._compiled for fn in chunked_logprobs._EAGER), "the compiled functions ran"
    assert chunked_logprobs._compile_on[cpu]
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_compiler_failure_falls_back_to_the_eager_functions(monkeypatch):
    cpu = torch.device("cpu")

    def broken(*args):
        raise RuntimeError("no compiler here")

    monkeypatch.setitem(chunked_logprobs._compile_on, cpu, True)
    for fn in chunked_logprobs._EAGER:
        monkeypatch.setitem(decode_layer._compiled, fn, broken)
    case = _case(torch.float32, seed=6)
    expected = _values_and_grads(_plain, *case, None, 1.0)
    with pytest.warns(RuntimeWarning, match="compiling the log-softmax failed"):
        ours = _values_and_grads(_ours(8), *case, None, 1.0)
    assert chunked_logprobs._compile_on[cpu] is False
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
