"""The prefix store: longest kept prefix per weights, superseded prefixes, least-recently-used eviction."""

from __future__ import annotations

import pytest
import torch

from localtinker.engine.prefix_store import BLOCK_TOKENS, ENV_BUDGET, UNPROVEN_SHARE, PrefixStore, budget_from_env

LAYERS = 2


def kv(tokens: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """[layers, 1 head, tokens, 1]: each column holds its token id (+ or − the layer), so a test can read
    which tokens it got."""
    column = torch.tensor(tokens, dtype=torch.float32)[None, :, None]
    layers = torch.arange(LAYERS, dtype=torch.float32)[:, None, None, None]
    return column + layers, column - layers


def keep(store: PrefixStore, tokens: tuple[int, ...], weights: str = "w", proven: bool = True) -> None:
    store.keep(weights, tokens, *kv(tokens), proven=proven)


def test_the_longest_kept_prefix_is_found_and_extended_past_its_last_whole_block():
    store = PrefixStore(10_000)
    short, long = tuple(range(40)), tuple(range(70))
    keep(store, tuple(range(1000, 1040)))
    keep(store, short)
    keep(store, long[:35] + (9999,) * 5)  # agrees with ``long`` for 35 tokens
    found, length = store.longest_prefix("w", long + (1, 2))
    assert length == 40 and found.tokens == short
    assert torch.equal(found.keys[1][0, :length, 0], torch.arange(40, dtype=torch.float32) + 1)


def test_at_least_the_last_prompt_token_is_left_to_prefill():
    store = PrefixStore(10_000)
    prompt = tuple(range(50))
    keep(store, prompt)
    assert store.longest_prefix("w", prompt)[1] == 49
    assert store.longest_prefix("w", prompt[:BLOCK_TOKENS]) is None  # nothing worth reusing in one block


def test_prefixes_of_other_weights_or_shorter_than_a_block_are_not_reused():
    store = PrefixStore(10_000)
    keep(store, tuple(range(40)), weights="a")
    keep(store, tuple(range(500, 510)))  # shorter than a block: not kept
    assert store.longest_prefix("b", tuple(range(60))) is None
    assert len(store) == 1 and store.longest_prefix("a", tuple(range(60)))[1] == 40
    assert store.longest_prefix("a", tuple(range(1, 60))) is None  # differs in the first block


def test_a_longer_sequence_replaces_the_kept_prefix_it_extends():
    store = PrefixStore(10_000)
    keep(store, tuple(range(40)))
    keep(store, tuple(range(60)))
    keep(store, tuple(range(60)))  # kept already: refreshed, not stored twice
    assert len(store) == 1 and store.tokens == 60


def test_least_recently_used_sequences_leave_first_within_the_token_budget():
    store = PrefixStore(100)
    first, second, third = (tuple(range(start, start + 40)) for start in (0, 1000, 2000))
    keep(store, first)
    keep(store, second)
    store.longest_prefix("w", first + (1,))  # a lookup makes ``first`` the most recently used
    keep(store, third)
    assert store.tokens == 80 and store.longest_prefix("w", second + (1,)) is None
    assert store.longest_prefix("w", first + (1,)) is not None and store.longest_prefix("w", third + (1,)) is not None
    keep(store, tuple(range(5000, 5101)))  # larger than the whole budget: not kept, nothing evicted for it
    assert store.tokens == 80


def test_unproven_prompts_hold_at_most_their_share_and_leave_before_proven_sequences():
    store = PrefixStore(400)
    assert UNPROVEN_SHARE * 400 == 100
    prompts = [tuple(range(start, start + 40)) for start in (0, 1000, 2000)]
    for prompt in prompts:
        keep(store, prompt, proven=False)
    assert store.unproven_tokens == 80 and store.longest_prefix("w", prompts[0] + (1,)) is None  # the oldest left
    assert store.longest_prefix("w", prompts[1] + (1,))[1] == 40  # extended: now proven
    assert store.unproven_tokens == 40 and store.tokens == 80
    for start in range(3000, 12000, 1000):  # 9 proven sequences: 440 tokens with the two kept
        keep(store, tuple(range(start, start + 40)))
    assert store.tokens == 400 and store.unproven_tokens == 0  # the unproven prompt left first
    assert store.longest_prefix("w", prompts[1] + (1,)) is not None
    keep(store, tuple(range(12000, 12040)))
    assert store.tokens == 400  # then the least recently used proven one: the first
    assert store.longest_prefix("w", tuple(range(3000, 3041))) is None
    assert store.longest_prefix("w", prompts[1] + (1,)) is not None


def test_a_sequence_that_extends_a_proven_one_is_proven():
    store = PrefixStore(400)
    keep(store, tuple(range(40)))
    keep(store, tuple(range(60)), proven=False)
    assert len(store) == 1 and store.unproven_tokens == 0


def test_a_zero_budget_turns_the_store_off(monkeypatch):
    monkeypatch.setenv(ENV_BUDGET, "0")
    store = PrefixStore()
    keep(store, tuple(range(40)))
    assert not store.enabled and len(store) == 0 and store.longest_prefix("w", tuple(range(50))) is None


@pytest.mark.parametrize("value", ["-1", "lots"])
def test_a_bad_budget_in_the_environment_says_what_to_give(monkeypatch, value):
    monkeypatch.setenv(ENV_BUDGET, value)
    with pytest.raises(ValueError, match=f"{ENV_BUDGET}=.*number of tokens >= 0"):
        budget_from_env()


def test_a_proven_sequence_does_not_keep_its_prefill_chunks_buffer_alive():
    """Kept prompts are views of one gather per prefill chunk; one that turns proven may outlive its
    neighbours, so it gets storage of its own (else the whole chunk's keys stay alive, uncounted)."""
    store = PrefixStore(10_000)
    prompts = [tuple(range(start, start + 40)) for start in (0, 1000, 2000)]
    chunk_keys = torch.stack([kv(prompt)[0] for prompt in prompts])
    chunk_values = torch.stack([kv(prompt)[1] for prompt in prompts])
    for row, prompt in enumerate(prompts):
        store.keep("w", prompt, chunk_keys[row], chunk_values[row], proven=False)
    found, _ = store.longest_prefix("w", prompts[1] + (1,))
    assert found.keys.untyped_storage().nbytes() == found.keys.nbytes
    assert found.values.untyped_storage().nbytes() == found.values.nbytes
    assert torch.equal(found.keys, chunk_keys[1]) and torch.equal(found.values, chunk_values[1])
    promoted, _ = store.longest_prefix("w", prompts[2] + (1,))  # promoted as well: each gets its own copy
    assert promoted.keys.data_ptr() != chunk_keys[2].data_ptr()
    store.keep("w", tuple(range(5000, 5040)), chunk_keys[0], chunk_values[0], proven=True)
    (kept,) = [k for k in store._orders[True].values() if k.tokens[0] == 5000]
    assert kept.keys.untyped_storage().nbytes() == kept.keys.nbytes
