"""Pair batches: pairs stay together, order is deterministic per (seed, epoch), bad pairs are named."""

import dataclasses

import numpy as np
import pytest

from posttrain.preference.data import BadPairError, PairBatching, PreferencePairs, pairs_from_table
from tests.posttrain.preference.tiny_pairs import pairs_table


@pytest.fixture(scope="module")
def pairs() -> PreferencePairs:
    return PreferencePairs.from_table(pairs_table(9))


def test_every_batch_holds_whole_pairs_chosen_then_rejected(pairs):
    batching = PairBatching(num_pairs=len(pairs), batch_size=4, num_epochs=2, seed=7)
    assert batching.num_steps() == 6  # 3 batches (4, 4, 1) per epoch
    for step in range(batching.num_steps()):
        indices = batching.pair_indices(step)
        data = pairs.data_at(indices)
        assert len(data) == 2 * len(indices)
        for position, index in enumerate(indices):
            pair = pairs.pairs[int(index)]
            assert data[2 * position].model_input.to_ints() == pair.chosen.model_input
            assert data[2 * position + 1].model_input.to_ints() == pair.rejected.model_input


def test_each_epoch_covers_every_pair_once_with_a_partial_last_batch():
    batching = PairBatching(num_pairs=9, batch_size=4, num_epochs=2, seed=1)
    for epoch in range(2):
        steps = range(epoch * 3, epoch * 3 + 3)
        seen = np.concatenate([batching.pair_indices(step) for step in steps])
        assert sorted(seen.tolist()) == list(range(9))
        assert [len(batching.pair_indices(step)) for step in steps] == [4, 4, 1]
        assert {batching.epoch_of(step) for step in steps} == {epoch}


def test_drop_last_keeps_only_full_batches():
    batching = PairBatching(num_pairs=9, batch_size=4, num_epochs=1, drop_last=True)
    assert batching.num_steps() == 2
    assert all(len(batching.pair_indices(step)) == 4 for step in range(2))
    with pytest.raises(ValueError, match="no complete batch"):
        PairBatching(num_pairs=3, batch_size=4, drop_last=True)


def test_order_depends_only_on_seed_and_epoch():
    first = PairBatching(num_pairs=20, batch_size=3, num_epochs=2, seed=5)
    again = PairBatching(num_pairs=20, batch_size=3, num_epochs=2, seed=5)
    other = PairBatching(num_pairs=20, batch_size=3, num_epochs=2, seed=6)
    steps = range(first.num_steps())
    assert all(np.array_equal(first.pair_indices(s), again.pair_indices(s)) for s in steps)
    assert any(not np.array_equal(first.pair_indices(s), other.pair_indices(s)) for s in steps)
    assert not np.array_equal(first.pair_indices(0), first.pair_indices(7))  # epoch 1 is reshuffled
    unshuffled = PairBatching(num_pairs=20, batch_size=3, shuffle=False)
    assert unshuffled.pair_indices(1).tolist() == [3, 4, 5]


def test_split_filter_keeps_heldout_pairs_out_of_training():
    table = pairs_table(8, heldout_every=4)
    assert [pair.row_id for pair in pairs_from_table(table)] == ["pair0", "pair1", "pair2", "pair4", "pair5", "pair6"]
    assert len(pairs_from_table(table, split=None)) == 8


def _broken(pairs: PreferencePairs, **changes):
    first = pairs.pairs[0]
    return [dataclasses.replace(first, **changes), *pairs.pairs[1:]]


def test_identical_sides_are_refused_with_the_row_id(pairs):
    with pytest.raises(BadPairError, match=r"preference pair 'pair0': chosen and rejected are identical.*fix or drop"):
        PreferencePairs(_broken(pairs, rejected=pairs.pairs[0].chosen))


def test_different_prompts_are_refused_with_the_row_id(pairs):
    with pytest.raises(BadPairError, match=r"'pair0': chosen and rejected do not share their first \d+ prompt tokens"):
        PreferencePairs(_broken(pairs, rejected=pairs.pairs[1].rejected))


def test_an_empty_response_is_refused_with_the_fix(pairs):
    chosen = pairs.pairs[0].chosen
    untrained = dataclasses.replace(chosen, weights=[0.0] * len(chosen.weights))
    with pytest.raises(BadPairError, match=r"'pair0': the chosen response has no trained tokens.*raise max_length"):
        PreferencePairs(_broken(pairs, chosen=untrained))


def test_duplicate_row_ids_and_missing_columns_are_refused(pairs):
    with pytest.raises(BadPairError, match="'pair1': row_id appears more than once"):
        PreferencePairs([*pairs.pairs, pairs.pairs[1]])
    with pytest.raises(ValueError, match=r"lacks columns \['prompt_length'\]"):
        pairs_from_table(pairs_table(2).drop_columns(["prompt_length"]))


def test_the_digest_changes_with_the_data(pairs):
    assert pairs.digest() == PreferencePairs.from_table(pairs_table(9)).digest()
    assert pairs.digest() != PreferencePairs.from_table(pairs_table(8)).digest()
