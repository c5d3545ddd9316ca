"""How an admission's prompts are grouped for prefill (the decoding itself: test_sample_stream.py)."""

from __future__ import annotations

from localtinker.engine.decode_batch import length_chunks
from localtinker.engine.shared_prompt_kv import width_class


def test_prompts_are_prefilled_in_groups_of_one_width_class():
    lengths = [1000, 30, 400, 31, 12, 45, 44, 1100]
    chunks = length_chunks(lengths)
    assert sorted(i for chunk in chunks for i in chunk) == list(range(len(lengths)))
    assert chunks == [[4, 1, 3], [6, 5], [2], [0, 7]]  # shortest first; 1000 and 1100 are one class
    for chunk in chunks:
        assert len({width_class(lengths[i]) for i in chunk}) == 1


def test_a_group_holds_at_most_the_token_cap_unless_one_prompt_exceeds_it():
    chunks = length_chunks([100] * 10 + [300], max_tokens=350)
    assert chunks == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9], [10]]
    assert length_chunks([500], max_tokens=350) == [[0]]


def test_lengths_close_to_a_groups_shortest_join_it_across_a_class_boundary():
    """Each further group costs a whole forward: 38 and 41 are two width classes but 3 columns apart."""
    assert width_class(38) != width_class(41)
    assert length_chunks([41, 38, 40]) == [[1, 2, 0]]
    # padding at most ~¼ of the group's longest, measured from its shortest: no creeping from 40 to 80
    lengths = [40, 48, 56, 64, 72, 80]
    assert length_chunks(lengths) == [[0, 1], [2, 3, 4], [5]]
