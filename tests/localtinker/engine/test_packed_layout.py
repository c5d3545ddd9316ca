"""packed_layout.py: micro-batches that lay a shared prompt once keep every datum's tokens, positions and
targets, stay within the budget, and give the hidden states, logprobs and gradients of packing every datum
whole (float32 ≤ 1e-5) — through the attention alone, the written-out layers, and the portable engine (the
CUDA path's code, uncompiled on the CPU) against an independent reference model — with fewer tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localtinker.engine import packed_rows as packed_rows_module
from localtinker.engine.api import AdamSpec, LoraSpec
from localtinker.engine.engine import LocalEngine
from localtinker.engine.packed_layers import PackedLayers
from localtinker.engine.packed_layout import PackedBatch, PackedLayout, packed_batches
from localtinker.engine.packed_rows import packed_rows
from localtinker.engine.portable_attention import packed_causal_attention
from tests.localtinker.engine.reference import TINY, ReferenceModel
from tests.localtinker.engine.test_packed_layers import _engine
from tests.localtinker.engine.test_prefix_sharing import (
    assert_shared_run_is_the_reference, embedded_tokens, grouped_rl_data,
)

CPU = torch.device("cpu")


def _grouped(seed: int = 0, prompts: tuple[int, ...] = (20, 33), samples: int = 3,
             loners: tuple[int, ...] = (9, 26), system: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Inputs and shifted targets of GRPO-like datums: each prompt (after a common system prompt of ``system``
    tokens) with ``samples`` completions of their own lengths, plus datums sharing nothing."""
    rng = np.random.default_rng(seed)
    system_tokens = rng.integers(0, 49152, size=system)
    sequences = []
    for length in prompts:
        prompt = np.concatenate([system_tokens, rng.integers(0, 49152, size=length)])
        sequences += [np.concatenate([prompt, rng.integers(0, 49152, size=int(rng.integers(2, 12)))])
                      for _ in range(samples)]
    sequences += [rng.integers(0, 49152, size=n) for n in loners]
    order = rng.permutation(len(sequences))
    sequences = [sequences[i] for i in order]
    return ([torch.as_tensor(s[:-1]) for s in sequences], [torch.as_tensor(s[1:]) for s in sequences])


def _assert_every_datum_laid_once(batches: list[PackedBatch], tokens: list[torch.Tensor],
                                  targets: list[torch.Tensor]) -> None:
    seen = []
    for batch in batches:
        for index, rows in batch.datum_rows.items():
            seen.append(index)
            assert torch.equal(batch.input_ids[rows], tokens[index])
            assert torch.equal(batch.targets[rows], targets[index])
            assert torch.equal(batch.position_ids[rows], torch.arange(tokens[index].shape[0]))
        assert sum(batch.q_lengths) == batch.tokens
    assert sorted(seen) == list(range(len(tokens)))


def test_without_sharing_datums_pack_in_order_within_the_budget():
    tokens = [torch.arange(n) for n in (5, 5, 5, 20, 3)]
    batches = packed_batches(tokens, tokens, budget=12, share=False)
    assert [list(b.datum_rows) for b in batches] == [[0, 1], [2], [3], [4]]  # a longer datum runs alone
    assert all(not b.layout(CPU).shared for b in batches)
    _assert_every_datum_laid_once(batches, tokens, tokens)


def test_a_group_lays_its_prompt_once_and_each_member_its_own_tokens():
    tokens, targets = _grouped()
    [shared] = packed_batches(tokens, targets, budget=10**6, share=True)
    [whole] = packed_batches(tokens, targets, budget=10**6, share=False)
    _assert_every_datum_laid_once([shared], tokens, targets)
    # two prompts of 20 and 33 tokens, 3 samples each: (3 − 1) × (prompt − 1) positions fewer (module docstring)
    assert whole.tokens - shared.tokens == 2 * 19 + 2 * 32
    layout = shared.layout(CPU)
    assert layout.shared and len(layout.q_lengths) == 2 * (1 + 3) + 2
    # keys: every member reads its prompt and its own tokens (a whole datum's worth), each prompt reads itself
    assert int(layout.key_rows.shape[0]) == sum(layout.k_lengths) == whole.tokens + 19 + 32


@pytest.mark.parametrize("budget", [40, 60, 100])
def test_a_group_bigger_than_the_budget_lays_its_prompt_again_in_each_part(budget):
    tokens, targets = _grouped(seed=1, prompts=(33,), samples=6, loners=(50,))
    batches = packed_batches(tokens, targets, budget=budget, share=True)
    _assert_every_datum_laid_once(batches, tokens, targets)
    for batch in batches:
        assert batch.tokens <= budget or len(batch.datum_rows) == 1
    assert len(batches) > 1


def test_a_system_prompt_in_front_of_every_group_is_laid_once_per_micro_batch():
    tokens, targets = _grouped(seed=6, prompts=(20, 33, 25), system=24)
    [shared] = packed_batches(tokens, targets, budget=10**6, share=True)
    [whole] = packed_batches(tokens, targets, budget=10**6, share=False)
    _assert_every_datum_laid_once([shared], tokens, targets)
    # per group, its prompt (system included) but its last position, 3 − 1 times fewer; the system prompt but its
    # last position, 3 − 1 times fewer again
    assert whole.tokens - shared.tokens == 2 * (24 + 19) + 2 * (24 + 32) + 2 * (24 + 24) + 2 * 23
    layout = shared.layout(CPU)
    assert layout.q_lengths[0] == 23  # the root first, then each group's own prefix after it


def test_datums_with_one_prompt_but_targets_of_their_own_share_only_where_the_targets_agree():
    rng = np.random.default_rng(2)
    prompt = torch.as_tensor(rng.integers(0, 49152, size=30))
    targets = [torch.cat([prompt[1:21], torch.as_tensor(rng.integers(0, 49152, size=10))]) for _ in range(3)]
    [batch] = packed_batches([prompt] * 3, targets, budget=10**6, share=True)
    _assert_every_datum_laid_once([batch], [prompt] * 3, targets)
    assert batch.tokens == 20 + 3 * 10  # 20 positions agree on their targets: laid once


def segment_attention_by_datum(device: torch.device, dtype: torch.dtype, system: int = 0,
                               window: int | None = None) -> tuple[dict, dict]:
    """Each datum's attention output rows under the shared layout and under whole rows, for random q/k/v whose
    row depends on the datum's tokens up to it (so prompt rows are the same in every member; grouped-query heads);
    ``system``: a system prompt in front of every prompt (laid once as the micro-batch's root); ``window``: a
    sliding window."""
    tokens, targets = _grouped(seed=3, system=system)
    [shared] = packed_batches(tokens, targets, budget=10**6, share=True)
    [whole] = packed_batches(tokens, targets, budget=10**6, share=False)
    generator = torch.Generator().manual_seed(0)
    rows: dict[tuple[int, ...], torch.Tensor] = {}

    def qkv(batch: PackedBatch) -> torch.Tensor:
        out = torch.empty((batch.tokens, 4 * 64 + 2 * 2 * 64))
        for index, datum_rows in batch.datum_rows.items():
            for position, row in enumerate(datum_rows.tolist()):
                key = tuple(tokens[index][: position + 1].tolist())
                if key not in rows:
                    rows[key] = torch.randn(out.shape[1], generator=generator)
                out[row] = rows[key]
        return out.to(device, dtype)

    outputs = []
    for batch in (shared, whole):
        q, k, v = qkv(batch).split([256, 128, 128], dim=1)
        out = packed_causal_attention(q.reshape(-1, 4, 64), k.reshape(-1, 2, 64), v.reshape(-1, 2, 64),
                                      batch.layout(device), scaling=64**-0.5, window=window)
        outputs.append({index: out[r.to(device)].float().cpu() for index, r in batch.datum_rows.items()})
    return outputs[0], outputs[1]


@pytest.mark.parametrize("window", [None, 7], ids=["causal", "window"])
@pytest.mark.parametrize("system", [0, 24], ids=["prompts", "system-prompt"])
def test_segment_attention_equals_attending_each_datum_whole(system, window):
    """The shared layout's attention gives each datum's rows what causal attention over the datum alone gives,
    with a sliding window too (a member's queries are its keys' last rows: the window is aligned at their end)."""
    shared, whole = segment_attention_by_datum(CPU, torch.float32, system, window)
    for index, expected in whole.items():
        torch.testing.assert_close(shared[index], expected, atol=1e-6, rtol=0)


def test_a_sliding_window_hides_the_keys_as_transformers_mask_does():
    """Packed rows with a window of 5 against the explicit product under transformers' own sliding mask, datum by
    datum: a query at position p sees keys p − 4 … p."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    from localtinker.engine.portable_attention import explicit_attention

    generator = torch.Generator().manual_seed(1)
    lengths = [12, 3, 9]
    q, k, v = (torch.randn(sum(lengths), heads, 16, generator=generator) for heads in (4, 2, 2))
    out = packed_causal_attention(q, k, v, PackedLayout.rows(lengths, CPU), scaling=0.25, window=5)
    start = 0
    for n in lengths:
        visible = sliding_window_causal_mask_function(5)(torch.tensor(0), torch.tensor(0), torch.arange(n)[:, None],
                                                         torch.arange(n)[None])
        assert visible[n - 1].sum() == min(n, 5)
        rows = slice(start, start + n)
        expected = explicit_attention(*(t[rows].transpose(0, 1)[None] for t in (q, k, v)), visible[None, None], 0.25)
        torch.testing.assert_close(out[rows], expected[0], atol=1e-6, rtol=0)
        start += n


@pytest.mark.parametrize("family,system", [("llama", 0), ("qwen3", 0), ("llama", 24), ("qwen3_moe", 0),
                                           ("mistral_sliding", 24), ("gpt_oss", 24), ("gemma2", 24)])
def test_the_written_out_layers_give_each_datum_its_whole_hidden_states_and_gradients(tmp_path, family, system):
    engine, model_id = _engine(tmp_path, family)
    model = engine._models[model_id]
    host = engine._hosts[model.base_name]
    layers = PackedLayers(host.base.model, compiled=False)
    tokens, targets = _grouped(seed=4, system=system)
    weights = torch.linspace(-1, 1, host.base.model.config.hidden_size)
    results = {}
    for share in (True, False):
        for param in model.params.values():
            param.grad = None
        [batch] = packed_batches(tokens, targets, budget=10**6, share=share)
        with host.adapters.activated(model.adapter):
            rows = packed_rows(host.base.model.get_decoder(), batch, CPU, layers)
            # the same function of each datum's hidden states, its prompt rows counted once per member
            sum((rows.hidden[r] * weights).sum() for r in rows.datum_rows.values()).backward()
        hidden = {index: rows.hidden[r].detach() for index, r in rows.datum_rows.items()}
        grads = {k: p.grad.clone() for k, p in model.params.items() if p.grad is not None}
        results[share] = hidden, grads, batch.tokens
    (hidden, grads, shared_tokens), (whole_hidden, whole_grads, whole_tokens) = results[True], results[False]
    assert shared_tokens < whole_tokens and grads.keys() == whole_grads.keys() and grads
    for index, expected in whole_hidden.items():
        torch.testing.assert_close(hidden[index], expected, atol=1e-5, rtol=0)
    for key, expected in whole_grads.items():
        torch.testing.assert_close(grads[key], expected, atol=1e-5 * float(expected.abs().max()), rtol=0, msg=key)


def test_a_micro_batch_with_shared_prompts_cannot_fall_back_to_transformers_layers():
    tokens, targets = _grouped(seed=5)
    [batch] = packed_batches(tokens, targets, budget=10**6, share=True)
    with pytest.raises(RuntimeError, match="written-out layers"):
        packed_rows(torch.nn.Identity(), batch, CPU, None)


@pytest.fixture(scope="module")
def cuda_path(tmp_path_factory) -> LocalEngine:
    """The portable engine as a GPU runs it (written-out layers, uncompiled on the CPU)."""
    return LocalEngine(tmp_path_factory.mktemp("cuda-path"), dtype="float32", portable=True, static_decode=False,
                       train_layers=True)


@pytest.mark.parametrize("name", ["importance_sampling", "ppo"])
def test_the_portable_trainer_shares_prompts_with_the_reference_results(cuda_path, monkeypatch, name):
    """GRPO-shaped batches (3 prompts × 4 samples and two loners) through forward_backward: the logprobs,
    losses and gradients of an independent transformers + peft model, with and without sharing, and fewer
    tokens through the model with it."""
    model_id = f"layout:{name}"
    cuda_path.create_model(model_id, TINY, LoraSpec(rank=4, seed=5))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for key, param in cuda_path._models[model_id].params.items():
            if key.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    reference = ReferenceModel(cuda_path.lora_spec(model_id), cuda_path.lora_weights(model_id))
    data = grouped_rl_data(reference, seed=7)
    runs = {}
    for share in (False, True):
        monkeypatch.setattr(packed_rows_module, "SHARE_PROMPTS", share)
        result = []
        tokens = embedded_tokens(cuda_path, lambda: result.append(
            cuda_path.forward_backward(model_id, data, name, None, False)))
        runs[share] = result[0], cuda_path.lora_grads(model_id), tokens
        cuda_path.optim_step(model_id, AdamSpec(learning_rate=0.0))
    assert_shared_run_is_the_reference(name, reference, data, runs)


def test_the_layout_of_plain_rows_reads_the_packed_keys_themselves():
    layout = PackedLayout.rows([3, 4], CPU)
    assert not layout.shared and layout.cu_q.tolist() == layout.cu_k.tolist() == [0, 3, 7]
    assert (layout.max_q, layout.max_k) == (4, 4)


def test_the_portable_trainer_runs_a_system_prompt_once(cuda_path, monkeypatch):
    """Three prompts behind one 20-token system prompt, 4 samples each: the same logprobs as without the root,
    with (3 − 1) × 19 tokens fewer through the model."""
    from localtinker.engine import packed_layout

    model_id = "layout:root"
    cuda_path.create_model(model_id, TINY, LoraSpec(rank=4, seed=5))
    reference = ReferenceModel(cuda_path.lora_spec(model_id), cuda_path.lora_weights(model_id))
    data = grouped_rl_data(reference, seed=8, system=20)
    runs = []
    for root in (True, False):
        if not root:
            monkeypatch.setattr(packed_layout, "common_root", lambda groups, keys: 0)
        result = []
        tokens = embedded_tokens(cuda_path, lambda: result.append(
            cuda_path.forward_backward(model_id, data, "importance_sampling", None, True)))
        runs.append(([o["logprobs"] for o in result[0].loss_fn_outputs], tokens))
    (with_root, root_tokens), (without, plain_tokens) = runs
    assert plain_tokens - root_tokens == 2 * 19
    for a, b in zip(with_root, without):
        np.testing.assert_allclose(a, b, atol=1e-5)
