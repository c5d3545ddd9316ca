"""Tournament pair sets and win fractions."""

import itertools

import pytest

from posttrain.preference.tournament import all_pairs_both_ways, all_pairs_one_way, chunks, tournament_pairs, win_fractions


@pytest.mark.parametrize("n", range(2, 9))
def test_one_way_is_every_unordered_pair_once_first_index_lower(n):
    pairs = tournament_pairs(n, "all_pairs_one_way")
    assert pairs == all_pairs_one_way(n)
    assert len(pairs) == n * (n - 1) // 2
    assert all(i < j for i, j in pairs)
    assert set(pairs) == set(itertools.combinations(range(n), 2))


@pytest.mark.parametrize("n", range(2, 9))
def test_both_ways_is_every_ordered_pair_once(n):
    pairs = tournament_pairs(n, "all_pairs_both_ways")
    assert pairs == all_pairs_both_ways(n)
    assert len(pairs) == len(set(pairs)) == n * (n - 1)
    assert set(pairs) == set(itertools.permutations(range(n), 2))


@pytest.mark.parametrize("n", range(2, 9))
@pytest.mark.parametrize("pattern", ["all_pairs_one_way", "all_pairs_both_ways"])
def test_every_sample_plays_the_same_number_of_games(n, pattern):
    pairs = tournament_pairs(n, pattern)
    games = [sum(k in pair for pair in pairs) for k in range(n)]
    assert games == [(n - 1) * (2 if pattern == "all_pairs_both_ways" else 1)] * n


def test_chunked_pairs_stay_within_chunks_and_a_lone_sample_joins_the_previous_chunk():
    assert [list(c) for c in chunks(8, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(c) for c in chunks(7, 3)] == [[0, 1, 2], [3, 4, 5, 6]]
    assert [list(c) for c in chunks(5, 0)] == [[0, 1, 2, 3, 4]]
    assert tournament_pairs(4, "all_pairs_one_way", chunk_size=2) == [(0, 1), (2, 3)]
    assert tournament_pairs(4, "all_pairs_both_ways", chunk_size=2) == [(0, 1), (1, 0), (2, 3), (3, 2)]
    assert len(tournament_pairs(8, "all_pairs_one_way", chunk_size=4)) == 2 * 6
    with pytest.raises(ValueError, match="chunk_size=1"):
        tournament_pairs(4, "all_pairs_one_way", chunk_size=1)
    with pytest.raises(ValueError, match="not one of"):
        tournament_pairs(4, "round_robin")
    with pytest.raises(ValueError, match="at least 2 samples"):
        tournament_pairs(1)


def test_reward_is_the_win_fraction():
    # 3 samples, one way: (0,1) 1 wins, (0,2) tie, (1,2) 1 wins by 0.75
    pairs = tournament_pairs(3)
    assert pairs == [(0, 1), (0, 2), (1, 2)]
    wins = win_fractions(3, pairs, [1.0, 0.5, 0.25])
    assert wins == pytest.approx([(0.0 + 0.5) / 2, (1.0 + 0.75) / 2, (0.5 + 0.25) / 2])
    both = tournament_pairs(3, "all_pairs_both_ways")
    assert win_fractions(3, both, [1.0] * 6) == pytest.approx([0.5, 0.5, 0.5])  # second always wins: no signal
    with pytest.raises(ValueError, match="one verdict per pair"):
        win_fractions(3, pairs, [1.0])
    with pytest.raises(ValueError, match="no comparison"):
        win_fractions(3, [(0, 1)], [1.0])
