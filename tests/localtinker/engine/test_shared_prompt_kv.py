"""The decode cache that stores a prompt once for all its rows: exact attention, and the bookkeeping."""

from __future__ import annotations

import pytest
import torch

from localtinker.engine.api import EngineUserError
from localtinker.engine.decode_batch import DecodeBatch
from localtinker.engine.kv_rows import ColumnBufferLayer, RowCache
from localtinker.engine.models import tiny_random_dir
from localtinker.engine.shared_prompt_kv import RowGroups, SharedPromptCache, SharedPromptKV, shared_prompt_attention

KEY_HEADS, QUERY_HEADS, DIM = 2, 6, 8


def _prefill(generator: torch.Generator, prompts: int, width: int, lengths: list[int]) -> tuple[RowCache, torch.Tensor]:
    keys = torch.randn(prompts, KEY_HEADS, width, DIM, generator=generator)
    values = torch.randn(prompts, KEY_HEADS, width, DIM, generator=generator)
    mask = torch.zeros(prompts, width, dtype=torch.long)
    for index, length in enumerate(lengths):
        mask[index, width - length :] = 1  # left-padded, as the prefill leaves them
    return RowCache([ColumnBufferLayer(keys, values)]), mask


def _decode_columns(cache: SharedPromptCache, generator: torch.Generator, steps: int) -> None:
    for _ in range(steps):
        cache.open_column()
        cache.layers[0].update(torch.randn(cache.rows, KEY_HEADS, 1, DIM, generator=generator),
                               torch.randn(cache.rows, KEY_HEADS, 1, DIM, generator=generator))


def _reference(query: torch.Tensor, cache: SharedPromptCache, scaling: float | None) -> torch.Tensor:
    """Plain float32 sdpa over every row's prompt copied in front of its own columns."""
    layer = cache.layers[0]
    rows = cache.prompt_of_row
    group = QUERY_HEADS // KEY_HEADS
    keys = torch.cat([layer.prompt_keys[rows], layer.own.keys], dim=-2).repeat_interleave(group, 1)
    values = torch.cat([layer.prompt_values[rows], layer.own.values], dim=-2).repeat_interleave(group, 1)
    mask = torch.cat([cache.prompt_mask[rows], cache.own_mask], dim=1)[:, None, None, :]
    output = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling)
    return output.transpose(1, 2)


def _mixed_cache(generator: torch.Generator) -> SharedPromptCache:
    """Three prompts of different lengths; groups of 3, 1 and 2 rows, not in prompt order; a later join."""
    cache = SharedPromptCache(layers=1)
    prefill, mask = _prefill(generator, 3, 7, [7, 3, 5])
    first = cache.add_prompts(prefill, mask, torch.arange(3))
    cache.add_rows(torch.tensor([first, first + 2, first, first + 1, first + 2, first]))
    _decode_columns(cache, generator, 2)
    prefill, mask = _prefill(generator, 2, 9, [9, 4])
    late = cache.add_prompts(prefill, mask, torch.tensor([1]))  # only the 4-token prompt is used
    cache.add_rows(torch.tensor([late, 0, late]))  # two rows of a new prompt, one more of prompt 0
    _decode_columns(cache, generator, 1)
    return cache


@pytest.mark.parametrize("scaling", [None, 0.3])
def test_attention_equals_sdpa_over_copied_prompts(scaling):
    generator = torch.Generator().manual_seed(0)
    cache = _mixed_cache(generator)
    assert cache.prompts == 4 and cache.rows == 9 and cache.prompt_mask.shape[1] == 9
    buckets = [(b.prompts.tolist(), b.rows.tolist()) for b in cache.groups.buckets]
    assert buckets == [([1], [[3]]), ([2, 3], [[1, 4], [6, 8]]), ([0], [[0, 2, 5, 7]])]
    query = torch.randn(cache.rows, QUERY_HEADS, 1, DIM, generator=generator)
    got = shared_prompt_attention(query, SharedPromptKV(cache.layers[0], cache), scaling)
    assert got.shape == (cache.rows, 1, QUERY_HEADS, DIM) and got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(query, cache, scaling), rtol=1e-5, atol=1e-6)


def test_bf16_keys_are_read_in_float32():
    generator = torch.Generator().manual_seed(1)
    cache = _mixed_cache(generator)
    layer = cache.layers[0]
    layer.prompt_keys, layer.prompt_values = layer.prompt_keys.bfloat16(), layer.prompt_values.bfloat16()
    layer.own = ColumnBufferLayer(layer.own.keys.bfloat16(), layer.own.values.bfloat16())
    query = torch.randn(cache.rows, QUERY_HEADS, 1, DIM, generator=generator).bfloat16()
    got = shared_prompt_attention(query, SharedPromptKV(layer, cache), None)
    layer.prompt_keys, layer.prompt_values = layer.prompt_keys.float(), layer.prompt_values.float()
    layer.own = ColumnBufferLayer(layer.own.keys.float(), layer.own.values.float())
    torch.testing.assert_close(got, _reference(query.float(), cache, None), rtol=1e-5, atol=1e-6)


def test_row_groups_bucket_prompts_by_size_and_see_row_order():
    grouped = RowGroups(torch.tensor([0, 0, 0, 1, 1, 1]), prompts=2)
    assert grouped.in_row_order and grouped.all_prompts and len(grouped.buckets) == 1
    assert grouped.buckets[0].rows.tolist() == [[0, 1, 2], [3, 4, 5]]
    mixed = RowGroups(torch.tensor([1, 0, 1, 2]), prompts=4)  # prompt 3 has no rows
    assert not mixed.in_row_order and not mixed.all_prompts
    assert [(b.prompts.tolist(), b.rows.tolist()) for b in mixed.buckets] == [([0, 2], [[1], [3]]), ([1], [[0, 2]])]
    order = torch.cat([b.rows.flatten() for b in mixed.buckets])
    assert order[mixed.inverse].tolist() == [0, 1, 2, 3]


def test_keep_rows_drops_prompts_and_columns_nobody_sees_and_keeps_the_attention():
    generator = torch.Generator().manual_seed(2)
    cache = _mixed_cache(generator)
    query = torch.randn(cache.rows, QUERY_HEADS, 1, DIM, generator=generator)
    before = _reference(query, cache, None)
    kept = torch.tensor([8, 3, 6])  # rows of prompts 3, 1, 3: prompts 0 and 2 go, and the 9-wide padding
    cache.keep_rows(kept)
    assert cache.prompts == 2 and cache.prompt_of_row.tolist() == [1, 0, 1]
    assert cache.prompt_mask.shape[1] == 4  # prompt 1 has 3 tokens, prompt 3 has 4
    assert cache.own_mask.shape[1] == 3 and cache.layers[0].own.keys.shape[:3] == (3, KEY_HEADS, 3)
    got = shared_prompt_attention(query[kept], SharedPromptKV(cache.layers[0], cache), None)
    torch.testing.assert_close(got, before[kept], rtol=1e-5, atol=1e-6)


def test_a_group_stores_its_prompt_once():
    generator = torch.Generator().manual_seed(3)
    cache = SharedPromptCache(layers=1)
    prefill, mask = _prefill(generator, 1, 5, [5])
    cache.add_rows(torch.full((8,), cache.add_prompts(prefill, mask, torch.arange(1))))
    _decode_columns(cache, generator, 3)
    assert cache.layers[0].prompt_keys.shape[0] == 1 and cache.layers[0].own.keys.shape[0] == 8
    assert cache.layers[0].get_seq_length() == 5 + 3  # what transformers sizes its masks by


def test_options_the_shared_path_lacks_fall_back_to_dense_sdpa():
    from localtinker.engine.float32_attention import float32_sdpa

    generator = torch.Generator().manual_seed(4)
    cache = _mixed_cache(generator)
    query = torch.randn(cache.rows, QUERY_HEADS, 1, DIM, generator=generator)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = QUERY_HEADS // KEY_HEADS, False, False
    view = SharedPromptKV(cache.layers[0], cache)
    with torch.inference_mode():
        shared, _ = float32_sdpa(module, query, view, view, None, scaling=None)
        dense, _ = float32_sdpa(module, query, view, view, None, scaling=None, sliding_window=4096)
    torch.testing.assert_close(dense, shared, rtol=1e-5, atol=1e-6)


def test_sampling_needs_the_engine_attention():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_random_dir(), attn_implementation="eager")
    with pytest.raises(EngineUserError, match="uses 'eager'"):
        DecodeBatch(model, AutoTokenizer.from_pretrained(tiny_random_dir()), (0,), 0)
