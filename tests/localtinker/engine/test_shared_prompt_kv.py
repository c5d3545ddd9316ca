"""The decode cache that stores a prompt once for all its rows: exact attention, bounded padding, bookkeeping."""

from __future__ import annotations

import pytest
import torch

from localtinker.engine.api import EngineUserError
from localtinker.engine.decode_batch import DecodeBatch
from localtinker.engine.kv_rows import ColumnBufferLayer, RowCache
from localtinker.engine.models import tiny_random_dir
from localtinker.engine.shared_prompt_kv import (
    RowGroups,
    SharedPromptCache,
    SharedPromptKV,
    close_widths,
    shared_prompt_attention,
    width_class,
)

KEY_HEADS, QUERY_HEADS, DIM = 2, 6, 8


class Mirror:
    """What every row attends to, kept beside the cache without padding: the reference's input."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator
        self.cache = SharedPromptCache(layers=1)
        self.prompts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> real keys, values [heads, n, dim]
        self.rows: list[list] = []  # per row: [prompt id, own keys, own values]

    def add_prompts(self, lengths: list[int], use: list[int]) -> list[int]:
        """A prefill of prompts of ``lengths`` (left-padded as the prefill leaves them); adds ``use`` of them."""
        width = max(lengths)
        keys = torch.randn(len(lengths), KEY_HEADS, width, DIM, generator=self.generator)
        values = torch.randn(len(lengths), KEY_HEADS, width, DIM, generator=self.generator)
        mask = torch.zeros(len(lengths), width, dtype=torch.long)
        for index, length in enumerate(lengths):
            mask[index, width - length :] = 1
        first = self.cache.add_prompts(RowCache([ColumnBufferLayer(keys, values)]), mask, torch.tensor(use))
        for k, index in enumerate(use):
            real = slice(width - lengths[index], width)
            self.prompts[first + k] = (keys[index, :, real], values[index, :, real])
        return [first + k for k in range(len(use))]

    def add_rows(self, prompt_ids: list[int]) -> None:
        self.cache.add_rows(torch.tensor(prompt_ids))
        empty = torch.zeros(KEY_HEADS, 0, DIM)
        self.rows += [[prompt, empty, empty] for prompt in prompt_ids]

    def decode(self, steps: int) -> None:
        for _ in range(steps):
            self.cache.open_column()
            keys = torch.randn(self.cache.rows, KEY_HEADS, 1, DIM, generator=self.generator)
            values = torch.randn(self.cache.rows, KEY_HEADS, 1, DIM, generator=self.generator)
            self.cache.layers[0].update(keys, values)
            for row, key, value in zip(self.rows, keys, values):
                row[1], row[2] = torch.cat([row[1], key], dim=1), torch.cat([row[2], value], dim=1)

    def keep_rows(self, kept: list[int]) -> None:
        self.cache.keep_rows(torch.tensor(kept))
        self.rows = [self.rows[i] for i in kept]

    def reference(self, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Plain float32 sdpa, row by row, over its prompt's real tokens followed by its own columns."""
        group = QUERY_HEADS // KEY_HEADS
        outputs = []
        for row, (prompt, own_keys, own_values) in enumerate(self.rows):
            prompt_keys, prompt_values = self.prompts[prompt]
            keys = torch.cat([prompt_keys, own_keys], dim=1).repeat_interleave(group, 0)
            values = torch.cat([prompt_values, own_values], dim=1).repeat_interleave(group, 0)
            outputs.append(torch.nn.functional.scaled_dot_product_attention(
                query[row : row + 1].float(), keys[None].float(), values[None].float(), scale=scaling))
        return torch.cat(outputs).transpose(1, 2)

    def attention(self, query: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        return shared_prompt_attention(query, SharedPromptKV(self.cache.layers[0], self.cache), scaling)

    def query(self) -> torch.Tensor:
        return torch.randn(self.cache.rows, QUERY_HEADS, 1, DIM, generator=self.generator)


def _mixed(seed: int) -> Mirror:
    """Prompts of 7, 3, 5 and 40 tokens (two width classes); groups of 3, 1 and 2 rows out of prompt order;
    a join after 2 steps (into the young cohort) and one after 12 more (a cohort of its own)."""
    mirror = Mirror(torch.Generator().manual_seed(seed))
    a, b, c = mirror.add_prompts([7, 3, 5], use=[0, 1, 2])
    mirror.add_rows([a, c, a, b, c, a])
    mirror.decode(2)
    (late,) = mirror.add_prompts([9, 4], use=[1])  # only the 4-token prompt is used
    mirror.add_rows([late, a, late])
    mirror.decode(12)
    (long,) = mirror.add_prompts([40], use=[0])
    mirror.add_rows([long, long, b])
    mirror.decode(1)
    return mirror


def test_widths_share_a_tensor_only_when_padding_stays_small():
    assert width_class(1) == width_class(32) == 0
    assert width_class(33) == width_class(40) != width_class(41)
    classes = {}
    for width in range(1, 5000):
        classes.setdefault(width_class(width), []).append(width)
    assert all(max(widths) <= max(32, 1.25 * min(widths)) for widths in classes.values())
    assert close_widths(100, 80) and not close_widths(100, 70) and close_widths(9, 1) and not close_widths(10, 1)


@pytest.mark.parametrize("scaling", [None, 0.3])
def test_attention_equals_sdpa_over_each_rows_real_tokens(scaling):
    mirror = _mixed(0)
    cache = mirror.cache
    assert cache.prompts == 5 and cache.rows == 12
    assert len(cache.prompt_masks) == 2 and [len(m) for m in cache.prompt_masks] == [4, 1]  # 3, 4, 5, 7 | 40
    assert [(c.start, c.rows, c.columns) for c in cache.cohorts] == [(0, 9, 15), (9, 3, 1)]
    query = mirror.query()
    got = mirror.attention(query, scaling)
    assert got.shape == (cache.rows, 1, QUERY_HEADS, DIM) and got.dtype == torch.float32
    torch.testing.assert_close(got, mirror.reference(query, scaling), rtol=1e-5, atol=1e-6)


def test_bf16_queries_take_bf16_products_with_a_float32_softmax():
    """As the engine's dense attention (attention.py): bf16 keys and queries multiply in bf16, so the result
    is the float32 reference on the same rounded inputs up to bf16 products' rounding, and not closer."""
    mirror = _mixed(1)
    layer = mirror.cache.layers[0]
    mirror.prompts = {i: (k.bfloat16().float(), v.bfloat16().float()) for i, (k, v) in mirror.prompts.items()}
    for row in mirror.rows:
        row[1], row[2] = row[1].bfloat16().float(), row[2].bfloat16().float()
    query = mirror.query().bfloat16()
    expected = mirror.reference(query.float(), None)
    layer.prompt_keys = [keys.bfloat16() for keys in layer.prompt_keys]
    layer.prompt_values = [values.bfloat16() for values in layer.prompt_values]
    got = mirror.attention(query)
    assert got.dtype == torch.float32
    error, scale = (got - expected).abs(), expected.abs().max()
    assert error.max() <= 0.02 * scale and error.mean() <= 0.003 * scale
    assert error.max() > 1e-4 * scale  # float32 products would agree to ~1e-6


def test_row_groups_bucket_prompts_by_shelf_and_size_and_see_row_order():
    one_shelf = torch.zeros(2, dtype=torch.long)
    grouped = RowGroups(torch.tensor([0, 0, 0, 1, 1, 1]), one_shelf, torch.arange(2), [2])
    assert grouped.in_row_order and len(grouped.buckets) == 1 and grouped.buckets[0].whole_shelf
    assert grouped.buckets[0].rows.tolist() == [[0, 1, 2], [3, 4, 5]]
    # prompts 0, 1, 3 on shelf 0 (slots 0, 1, 2), prompt 2 on shelf 1; prompt 3 has no rows
    mixed = RowGroups(torch.tensor([1, 0, 1, 2, 0]), torch.tensor([0, 0, 1, 0]), torch.tensor([0, 1, 0, 2]), [3, 1])
    assert not mixed.in_row_order
    assert [(b.shelf, b.slots.tolist(), b.rows.tolist(), b.whole_shelf) for b in mixed.buckets] == [
        (0, [0, 1], [[1, 4], [0, 2]], False), (1, [0], [[3]], True)]
    order = torch.cat([b.rows.flatten() for b in mixed.buckets])
    assert order[mixed.inverse].tolist() == [0, 1, 2, 3, 4]


def test_keep_rows_drops_prompts_and_columns_nobody_sees_and_keeps_the_attention():
    mirror = _mixed(2)
    query = mirror.query()
    before = mirror.reference(query, None)
    kept = [3, 6, 8, 9, 10]  # rows of prompts b, late, late, long, long: a, c and the 7-wide padding go
    mirror.keep_rows(kept)
    cache = mirror.cache
    assert cache.prompts == 3 and cache.prompt_of_row.tolist() == [0, 1, 1, 2, 2]
    assert [m.shape[1] for m in cache.prompt_masks] == [4, 40]  # b has 3 tokens, late 4
    assert [(c.start, c.rows, c.columns) for c in cache.cohorts] == [(0, 3, 15), (3, 2, 1)]
    assert cache.cohorts[0].mask is not None and cache.cohorts[0].mask.sum(dim=1).tolist() == [15, 13, 13]
    torch.testing.assert_close(mirror.attention(query[kept]), before[kept], rtol=1e-5, atol=1e-6)
    mirror.decode(20)  # the cohorts are now 35 and 21 wide: too far apart to share a tensor
    mirror.keep_rows([0, 1, 3, 4])
    assert [(c.start, c.rows, c.columns) for c in cache.cohorts] == [(0, 2, 35), (2, 2, 21)]
    mirror.decode(40)  # 75 and 61 wide: close enough, merged at the next compaction
    mirror.keep_rows([0, 1, 3])
    assert [(c.start, c.rows, c.columns) for c in cache.cohorts] == [(0, 3, 75)]
    query = mirror.query()
    torch.testing.assert_close(mirror.attention(query), mirror.reference(query, None), rtol=1e-5, atol=1e-6)


def test_padding_stays_a_fraction_of_what_rows_attend_to():
    """One long prompt and an old row do not widen everyone: stored columns stay within ~¼ of the real ones."""
    mirror = Mirror(torch.Generator().manual_seed(5))
    (long,) = mirror.add_prompts([1000], use=[0])
    mirror.add_rows([long])
    mirror.decode(200)  # an old row, 200 columns of its own
    short = mirror.add_prompts([30 + i % 7 for i in range(60)], use=list(range(60)))
    mirror.add_rows([p for p in short for _ in range(8)])
    mirror.decode(3)
    real = sum(mirror.prompts[p][0].shape[1] for p in mirror.prompts) + sum(r[1].shape[1] for r in mirror.rows)
    assert real <= mirror.cache.stored_columns <= 1.25 * real  # one shared tensor: 61 × 1000 + 481 × 203
    query = mirror.query()
    torch.testing.assert_close(mirror.attention(query), mirror.reference(query, None), rtol=1e-5, atol=1e-6)


def test_a_group_stores_its_prompt_once():
    mirror = Mirror(torch.Generator().manual_seed(3))
    (prompt,) = mirror.add_prompts([5], use=[0])
    mirror.add_rows([prompt] * 8)
    mirror.decode(3)
    layer = mirror.cache.layers[0]
    assert layer.prompt_keys[0].shape[0] == 1 and layer.own[0].keys.shape[0] == 8
    assert mirror.cache.stored_columns == 5 + 8 * 3
    assert layer.get_seq_length() == 5 + 3  # what transformers sizes its masks by


def test_a_new_shelf_holds_exactly_its_prompts_not_the_prefill_buffer():
    """The prefill writes into buffers with spare columns (kv_rows.SPARE_COLUMNS); a shelf keeping a view
    of one would hold that memory, uncounted by ``stored_columns``, for as long as the prompts live."""
    mirror = Mirror(torch.Generator().manual_seed(4))
    mirror.add_prompts([6, 9], use=[0, 1])  # every prompt of the prefill: no gather makes a copy
    layer = mirror.cache.layers[0]
    for stored in (layer.prompt_keys[0], layer.prompt_values[0]):
        assert stored.shape == (2, KEY_HEADS, 9, DIM)
        assert stored.untyped_storage().nbytes() == stored.numel() * stored.element_size()


def test_options_the_shared_path_lacks_fall_back_to_dense_sdpa():
    from localtinker.engine.attention import engine_attention

    mirror = _mixed(4)
    query = mirror.query()
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = QUERY_HEADS // KEY_HEADS, False, False
    view = SharedPromptKV(mirror.cache.layers[0], mirror.cache)
    with torch.inference_mode():
        shared, _ = engine_attention(module, query, view, view, None, scaling=None)
        dense, _ = engine_attention(module, query, view, view, None, scaling=None, sliding_window=4096)
    torch.testing.assert_close(dense, shared, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dense, mirror.reference(query, None), rtol=1e-5, atol=1e-6)


def test_sampling_needs_the_engine_attention():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_random_dir(), attn_implementation="eager")
    with pytest.raises(EngineUserError, match="uses 'eager'"):
        DecodeBatch(model, AutoTokenizer.from_pretrained(tiny_random_dir()), (0,), 0)
