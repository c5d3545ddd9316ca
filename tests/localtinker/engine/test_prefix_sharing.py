"""Shared-prompt training: the grouping, the micro-batches, and exact results against whole rows and an
independent reference model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import localtinker.engine.engine as engine_module
import localtinker.engine.attention as engine_attention_module
import localtinker.engine.logprobs as logprobs_module
import localtinker.engine.prefix_sharing as prefix_sharing
from localtinker.engine.api import AdamSpec, DatumArrays, LoraSpec
from localtinker.engine.prefix_sharing import (
    MAX_OWN_TOKENS,
    MIN_SHARED_TOKENS,
    PrefixGroup,
    common_root,
    group_by_prefix,
    shared_microbatches,
    sharing_keys,
)
from tests.localtinker.engine.reference import TINY, ReferenceModel, sft_datum
from tests.localtinker.engine.test_losses import assert_grad_close, reference_loss


def rows(*arrays) -> list[torch.Tensor]:
    return [torch.as_tensor(np.asarray(a, dtype=np.int64)) for a in arrays]


def test_groups_are_the_prompts_and_loners_stay_alone():
    rng = np.random.default_rng(0)
    header = rng.integers(0, 1000, size=12)
    prompts = [np.concatenate([header, rng.integers(1000, 2000, size=n)]) for n in (20, 31, 25)]
    data, expected = [], []
    for prompt in prompts:
        members = []
        for sample in range(4):
            members.append(len(data))
            data.append(np.concatenate([prompt, [3000 + 10 * len(data)], rng.integers(0, 1000, size=sample + 2)]))
        expected.append(PrefixGroup(tuple(members), len(prompt)))
    loners = [len(data), len(data) + 1]
    data += [rng.integers(0, 1000, size=40), rng.integers(0, 1000, size=5)]
    order = rng.permutation(len(data))
    groups = group_by_prefix(rows(*[data[i] for i in order]))
    renamed = {tuple(sorted(int(order[i]) for i in g.members)): g.shared for g in groups}
    assert renamed == {**{g.members: g.shared for g in expected}, **{(i,): 0 for i in loners}}


def test_every_member_keeps_a_token_of_its_own():
    groups = group_by_prefix(rows(range(30), range(30), range(30)))
    assert groups == [PrefixGroup((0, 1, 2), 29)]


def test_a_short_common_prefix_is_not_shared():
    short = MIN_SHARED_TOKENS - 1
    groups = group_by_prefix(rows([*range(short), 500, 501], [*range(short), 600, 601]))
    assert sorted(g.members for g in groups) == [(0,), (1,)] and all(g.shared == 0 for g in groups)


def test_the_partition_saving_most_tokens_wins():
    """A 20-token header shared by 8 datums (saves 7 × 20) loses to two 40-token prompts × 4 (2 × 3 × 40)."""
    header = list(range(20))
    data = [header + [100 + p] * 20 + [900 + 10 * p + s] for p in range(2) for s in range(4)]
    groups = group_by_prefix(rows(*data))
    assert sorted((g.members, g.shared) for g in groups) == [((0, 1, 2, 3), 40), ((4, 5, 6, 7), 40)]


def test_problems_under_one_system_prompt_keep_their_groups():
    """One run saves the 80-token system prompt for all 12 datums (11 × 80 > 3 × 3 × 96); inside it each
    problem's 4 samples share 16 more tokens, so they stay groups, with the system prompt as their root."""
    system = list(range(80))
    data = [system + [500 + p] * 16 + [900 + 10 * p + s, 7] for p in range(3) for s in range(4)]
    tokens = rows(*data)
    groups = group_by_prefix(tokens)
    assert sorted((g.members, g.shared) for g in groups) == [((0, 1, 2, 3), 96), ((4, 5, 6, 7), 96), ((8, 9, 10, 11), 96)]
    assert common_root(groups, tokens) == 80


def test_a_run_stays_whole_rather_than_leave_a_member_alone():
    """Three samples share 16 more tokens than the fourth (3 × 60 saved as one run > 2 × 76 without the
    fourth): splitting the run would cost the fourth its prompt, so it stays whole."""
    prompt = list(range(60))
    data = [prompt + [500] * 16 + [900 + s, 7] for s in range(3)] + [prompt + [600, 7]]
    assert group_by_prefix(rows(*data)) == [PrefixGroup((0, 1, 2, 3), 60)]


def of_lengths(lengths: list[int]) -> list[torch.Tensor]:
    """Datums of these lengths with no tokens in common (no root to share)."""
    return [torch.arange(length) + 100_000 * index for index, length in enumerate(lengths)]


def test_micro_batches_respect_the_budget_and_split_big_groups():
    lengths = [50] * 10 + [30] * 3 + [70] * 2 + [25, 30, 140]
    groups = [
        PrefixGroup(tuple(range(10)), 40),  # own parts of 10: two per chunk, (64 - 40) // 10
        PrefixGroup((10, 11, 12), 20),  # one chunk of 3: 20 + 3 × 10
        PrefixGroup((13, 14), 60),  # a prefix over budget, own parts shorter than it: one chunk of 2
        PrefixGroup((15, 16, 17), 20),  # own 5 and 10 fit together; own 120 > budget and > prefix: plain row
    ]
    batches, alone = shared_microbatches(groups, of_lengths(lengths), budget=64)
    chunks = sorted((chunk.members, chunk.shared) for batch in batches for chunk in batch)
    assert chunks == sorted(
        [((0, 1), 40), ((2, 3), 40), ((4, 5), 40), ((6, 7), 40), ((8, 9), 40)]
        + [((10, 11, 12), 20), ((13, 14), 60), ((15, 16), 20)]
    )
    assert alone == [17]
    for batch in batches:
        prefix = len(batch) * max(c.shared for c in batch)
        own = sum(len(c.members) for c in batch) * max(lengths[i] - c.shared for c in batch for i in c.members)
        assert prefix + own <= 64 or len(batch) == 1


def test_a_long_prefix_is_not_shared_with_longer_own_parts():
    """Over budget, sharing would add memory without saving work: the members run as plain rows."""
    batches, alone = shared_microbatches([PrefixGroup((0, 1), 300)], of_lengths([1000, 1000]), budget=512)
    assert batches == [] and alone == [0, 1]


def test_sharing_keys_follow_the_tokens_and_the_targets_before_them():
    tokens = rows([5, 6, 7, 8], [5, 6, 7, 9])
    shifted = [torch.cat([t[1:], torch.tensor([0])]) for t in tokens]
    keys = sharing_keys(tokens, shifted)
    assert int((keys[0] == keys[1]).sum()) == 3  # shifted targets: the keys agree where the tokens do
    own_targets = rows([6, 7, 8, 1], [6, 9, 8, 1])  # the same tokens, the second target differs
    keys = sharing_keys(rows([5, 6, 7, 8], [5, 6, 7, 8]), own_targets)
    assert (keys[0] == keys[1]).tolist() == [True, True, False, True]  # a common prefix of 2 positions


@pytest.fixture(scope="module")
def trained(engine):
    model_id = "sharing:train:0"
    engine.create_model(model_id, TINY, LoraSpec(rank=4, seed=5))
    engine.forward_backward(model_id, [sft_datum(np.random.default_rng(0), 30)], "cross_entropy", None, False)
    engine.optim_step(model_id, AdamSpec(learning_rate=0.05))
    return model_id


def grouped_rl_data(reference: ReferenceModel, seed: int, system: int = 0) -> list[DatumArrays]:
    """3 prompts × 4 samples of different lengths (advantages on the samples only), plus two loners;
    ``system`` > 0 puts a common system prompt of that many tokens in front of the three prompts."""
    rng = np.random.default_rng(seed)
    system_tokens = rng.integers(0, 49152, size=system)
    data = []
    for prompt_length in (18, 25, 30):
        prompt = np.concatenate([system_tokens, rng.integers(0, 49152, size=prompt_length)])
        prompt_length += system
        for _ in range(4):
            tokens = np.concatenate([prompt, rng.integers(0, 49152, size=int(rng.integers(2, 9)))])
            data.append(_rl_datum(reference, rng, tokens, prompt_length))
    for length in (22, 6):
        data.append(_rl_datum(reference, rng, rng.integers(0, 49152, size=length), 1))
    return [data[i] for i in rng.permutation(len(data))]


def _rl_datum(
    reference: ReferenceModel, rng: np.random.Generator, tokens: np.ndarray, prompt_length: int
) -> DatumArrays:
    with torch.no_grad():
        current = reference.logprobs(tokens[:-1], tokens[1:]).numpy()
    advantages = np.zeros(len(tokens) - 1, np.float32)
    advantages[prompt_length - 1 :] = rng.choice([-1.5, 0.5, 2.0])
    sampler = current + rng.choice([-0.3, -0.05, 0.05, 0.3], size=len(current))
    return DatumArrays(
        tokens=tokens[:-1],
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": np.where(advantages != 0, sampler, 0.0).astype(np.float32),
            "advantages": advantages,
            "sequence_ratio_mask": (advantages != 0).astype(np.float32),
        },
    )


def embedded_tokens(engine, run) -> int:
    """Token positions (padding included) the decoder embeds while ``run`` runs."""
    host = engine._hosts[TINY]
    counted = []
    embeddings = host.base.model.get_input_embeddings()
    handle = embeddings.register_forward_hook(lambda module, args, out: counted.append(args[0].numel()))
    try:
        run()
    finally:
        handle.remove()
    return sum(counted)


@pytest.mark.parametrize(
    "name,micro_batch,system,own_bound",
    [
        ("importance_sampling", 512, 0, MAX_OWN_TOKENS),
        ("ppo", 512, 0, MAX_OWN_TOKENS),
        ("gspo", 512, 0, MAX_OWN_TOKENS),
        ("importance_sampling", 20, 0, MAX_OWN_TOKENS),  # groups split into chunks of different sizes
        ("importance_sampling", 512, 20, MAX_OWN_TOKENS),  # a system prompt in front of every group: the root runs once
        ("ppo", 45, 20, MAX_OWN_TOKENS),
        ("importance_sampling", 512, 0, 0),  # own parts too long for the shared attention: prompts copied
        ("ppo", 45, 20, 0),
    ],
)
def test_shared_prompts_give_the_reference_results_with_fewer_tokens(
    engine, trained, monkeypatch, name, micro_batch, system, own_bound
):
    monkeypatch.setattr(engine_module, "TRAIN_MICROBATCH_TOKENS", micro_batch)
    monkeypatch.setattr(prefix_sharing, "MAX_OWN_TOKENS", own_bound)
    attended = _count_shared_attention_calls(monkeypatch)
    reference = ReferenceModel(engine.lora_spec(trained), engine.lora_weights(trained))
    data = grouped_rl_data(reference, seed=3, system=system)
    runs = {}
    for share in (False, True):
        monkeypatch.setattr(engine_module, "SHARE_PREFIXES", share)
        result = []
        tokens = embedded_tokens(
            engine, lambda: result.append(engine.forward_backward(trained, data, name, None, False))
        )
        runs[share] = (result[0], engine.lora_grads(trained), tokens)
        engine.optim_step(trained, AdamSpec(learning_rate=0.0))
    assert bool(attended) == bool(own_bound)  # which attention the members took
    assert_shared_run_is_the_reference(name, reference, data, runs)


def assert_shared_run_is_the_reference(name: str, reference: ReferenceModel, data: list[DatumArrays],
                                       runs: dict[bool, tuple]) -> None:
    """``runs[share]`` = (forward_backward result, LoRA gradients, tokens embedded) without and with sharing:
    sharing embeds under 3/4 of the tokens, and both give the reference model's logprobs, losses and gradients."""
    (whole, whole_grads, whole_tokens), (shared, shared_grads, shared_tokens) = runs[False], runs[True]
    assert shared_tokens < 0.75 * whole_tokens
    total = torch.zeros(())
    for datum, output, whole_output in zip(data, shared.loss_fn_outputs, whole.loss_fn_outputs):
        lp = reference.logprobs(datum.tokens, datum.loss_fn_inputs["target_tokens"])
        np.testing.assert_allclose(output["logprobs"], lp.detach().numpy(), atol=1e-5)
        np.testing.assert_allclose(output["logprobs"], whole_output["logprobs"], atol=1e-5)
        np.testing.assert_allclose(output["elementwise_loss"], whole_output["elementwise_loss"], atol=1e-4)
        total = total + reference_loss(name, lp, datum.loss_fn_inputs, {})
    total.backward()
    assert shared.metrics["loss:sum"] == pytest.approx(total.item(), rel=1e-5, abs=1e-4)
    for key, grad in reference.grads().items():
        assert_grad_close(shared_grads[key], grad, key)
        assert_grad_close(shared_grads[key], whole_grads[key], key)


def _count_shared_attention_calls(monkeypatch) -> list[int]:
    """Records each call of the members' shared-prompt attention (shared_prefix_attention.py)."""
    calls: list[int] = []
    original = engine_attention_module.shared_prefix_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(engine_attention_module, "shared_prefix_attention", counted)
    return calls


def test_a_common_system_prompt_runs_once_per_micro_batch(engine, trained, monkeypatch):
    reference = ReferenceModel(engine.lora_spec(trained), engine.lora_weights(trained))
    data = grouped_rl_data(reference, seed=5, system=24)
    groups = [g for g in group_by_prefix([torch.as_tensor(d.tokens) for d in data]) if g.shared]
    assert len(groups) == 3 and common_root(groups, [torch.as_tensor(d.tokens) for d in data]) == 24

    def run():
        result = engine.forward_backward(trained, data, "importance_sampling", None, forward_only=True)
        return [o["logprobs"] for o in result.loss_fn_outputs]

    with_root, logprobs = [], []
    with_root.append(embedded_tokens(engine, lambda: logprobs.append(run())))
    monkeypatch.setattr(prefix_sharing, "common_root", lambda groups, tokens: 0)
    without_root = embedded_tokens(engine, lambda: logprobs.append(run()))
    assert with_root[0] == without_root - 2 * 24  # three groups ran the system prompt once instead of three times
    for a, b in zip(*logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_groups_take_micro_batches_larger_by_the_shared_factor(engine, trained, monkeypatch):
    """A micro-batch of groups runs two or three passes (root, prompts, own tokens), each paying a whole
    pass's per-op cost: groups get SHARED_MICROBATCH_FACTOR × the plain budget, plain rows the budget."""
    reference = ReferenceModel(engine.lora_spec(trained), engine.lora_weights(trained))
    data = grouped_rl_data(reference, seed=6)
    decoder = engine._hosts[TINY].base.model.get_decoder()
    passes = []
    handle = decoder.register_forward_hook(lambda *args: passes.append(1))

    def count(factor: int) -> tuple[int, list]:
        monkeypatch.setattr(engine_module, "SHARED_MICROBATCH_FACTOR", factor)
        passes.clear()
        result = engine.forward_backward(trained, data, "importance_sampling", None, forward_only=True)
        return len(passes), [o["logprobs"] for o in result.loss_fn_outputs]

    # the three groups' micro-batch: prompts padded to 30 × 3 + own parts padded to ≤ 8 × 12 ≤ 186 tokens
    monkeypatch.setattr(engine_module, "TRAIN_MICROBATCH_TOKENS", 100)
    try:
        (larger, logprobs), (plain, plain_logprobs) = count(2), count(1)
    finally:
        handle.remove()
    # the two loners as one plain micro-batch, then the groups: one micro-batch (2 passes) against two or more
    assert larger == 1 + 2 and plain >= 1 + 4
    for a, b in zip(logprobs, plain_logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_forward_only_shares_prompts_too(engine, trained, monkeypatch):
    reference = ReferenceModel(engine.lora_spec(trained), engine.lora_weights(trained))
    data = grouped_rl_data(reference, seed=4)
    result = engine.forward_backward(trained, data, "importance_sampling", None, forward_only=True)
    monkeypatch.setattr(engine_module, "SHARE_PREFIXES", False)
    whole = engine.forward_backward(trained, data, "importance_sampling", None, forward_only=True)
    for a, b in zip(result.loss_fn_outputs, whole.loss_fn_outputs):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-5)


def test_only_weighted_positions_back_propagate_through_the_unembedding(engine, trained, monkeypatch):
    """Zero-weight positions get their logprobs without a graph; the tracked rows are the weighted ones."""
    seen = []
    apply = logprobs_module.TargetLogprob.apply
    def recording(logits, targets):
        seen.append((logits.shape[0], logits.requires_grad))
        return apply(logits, targets)

    monkeypatch.setattr(logprobs_module.TargetLogprob, "apply", recording)
    rng = np.random.default_rng(6)
    data = [sft_datum(rng, n) for n in (9, 14)]
    result = engine.forward_backward(trained, data, "cross_entropy", None, False)
    weighted = sum(int((d.loss_fn_inputs["weights"] != 0).sum()) for d in data)
    assert sum(rows for rows, tracked in seen if tracked) == weighted
    assert sum(rows for rows, _ in seen) == 9 + 14
    assert all(len(o["logprobs"]) == len(d.tokens) for o, d in zip(result.loss_fn_outputs, data))
    engine.optim_step(trained, AdamSpec(learning_rate=0.0))


def test_an_all_zero_batch_still_gives_zero_gradients(engine, new_id):
    """Adam must see a zero gradient (its moments decay, the weights move with momentum), not none."""
    model_id = new_id()
    engine.create_model(model_id, TINY, LoraSpec(rank=2, seed=1))
    datum = sft_datum(np.random.default_rng(2), 8)
    datum.loss_fn_inputs["weights"] = np.zeros(8, np.float32)
    engine.forward_backward(model_id, [datum], "cross_entropy", None, False)
    grads = engine.lora_grads(model_id)
    assert all(g is not None and not bool(g.any()) for g in grads.values())


def test_datums_with_one_prompt_but_targets_of_their_own_share_only_where_the_targets_agree(engine, trained):
    """A shared row's target must be every member's: three datums with the same 40 tokens whose targets agree
    on the first 20 positions only share 21 positions, and each gets the logprobs it gets alone."""
    rng = np.random.default_rng(9)
    tokens = rng.integers(0, 49152, size=40)
    common_targets = rng.integers(0, 49152, size=20)
    data = [DatumArrays(tokens=tokens, loss_fn_inputs={
        "target_tokens": np.concatenate([common_targets, rng.integers(0, 49152, size=20)]),
        "weights": np.ones(40, np.float32)}) for _ in range(3)]
    keys = sharing_keys([torch.as_tensor(d.tokens) for d in data],
                        [torch.as_tensor(d.loss_fn_inputs["target_tokens"]) for d in data])
    assert group_by_prefix(keys) == [PrefixGroup((0, 1, 2), 21)]
    together = engine.forward_backward(trained, data, "cross_entropy", None, forward_only=True)
    for datum, output in zip(data, together.loss_fn_outputs):
        alone = engine.forward_backward(trained, [datum], "cross_entropy", None, forward_only=True)
        np.testing.assert_allclose(output["logprobs"], alone.loss_fn_outputs[0]["logprobs"], atol=1e-5)
