"""Small preference data for tests: 'What is a + b?' with the right sum chosen and a wrong one rejected,
rendered through the real data path (chatml renderer, the tiny model's tokenizer = SmolLM2's)."""

from __future__ import annotations

from functools import lru_cache

import pyarrow as pa

from posttrain.datasets import schemas, tokens
from posttrain.renderers import get_renderer

TINY_MODEL = "localtinker/tiny-random"


@lru_cache(maxsize=1)
def tiny_tokenizer():
    from transformers import AutoTokenizer

    from localtinker.engine.models import tiny_random_dir

    return AutoTokenizer.from_pretrained(tiny_random_dir())


def comparisons_table(count: int, heldout_every: int = 0) -> pa.Table:
    rows = []
    for index in range(count):
        a, b = index % 7 + 1, index % 5 + 2
        rows.append(
            {
                "row_id": f"pair{index}",
                "source": "test",
                "split": "heldout" if heldout_every and index % heldout_every == heldout_every - 1 else "train",
                "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                "chosen": [{"role": "assistant", "content": f"{a + b}"}],
                "rejected": [{"role": "assistant", "content": f"{a + b + 3} maybe"}],
            }
        )
    return schemas.table_from_rows(rows, schemas.PREFERENCE_COMPARISONS)


def pairs_table(count: int, heldout_every: int = 0) -> pa.Table:
    renderer = get_renderer("chatml", tiny_tokenizer())
    return tokens.render_comparisons_table(comparisons_table(count, heldout_every), renderer, max_length=None)
