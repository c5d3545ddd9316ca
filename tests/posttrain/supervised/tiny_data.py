"""Small supervised examples for tests: 'Q: a+b=? A: c' with only the answer (and newline) trained."""

from __future__ import annotations

from functools import lru_cache

import pyarrow as pa

from posttrain.supervised import datum_from_tokens

TINY_MODEL = "localtinker/tiny-random"


@lru_cache(maxsize=1)
def tiny_tokenizer():
    """The tiny model's tokenizer (SmolLM2's), loaded offline from the directory the server uses."""
    from transformers import AutoTokenizer

    from localtinker.engine.models import tiny_random_dir

    return AutoTokenizer.from_pretrained(tiny_random_dir())


def arithmetic_rows(tokenizer, count: int, split_every: int = 0) -> list[dict]:
    """Rendered-token rows (the data layer's schema columns); every ``split_every``-th row is held out."""
    rows = []
    for index in range(count):
        a, b = index % 7 + 1, index % 5 + 2
        prompt = tokenizer.encode(f"Q: {a}+{b}=?\nA:", add_special_tokens=False)
        answer = tokenizer.encode(f" {a + b}\n", add_special_tokens=False)
        tokens = prompt + answer
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        rows.append(
            {
                "row_id": f"row{index}",
                "split": "heldout" if split_every and index % split_every == split_every - 1 else "train",
                "model_input": tokens[:-1],
                "target_tokens": tokens[1:],
                "weights": weights,
            }
        )
    return rows


def arithmetic_table(tokenizer, count: int, split_every: int = 0) -> pa.Table:
    rows = arithmetic_rows(tokenizer, count, split_every)
    return pa.table(
        {
            "row_id": [row["row_id"] for row in rows],
            "split": [row["split"] for row in rows],
            "model_input": pa.array([row["model_input"] for row in rows], pa.list_(pa.int32())),
            "target_tokens": pa.array([row["target_tokens"] for row in rows], pa.list_(pa.int32())),
            "weights": pa.array([row["weights"] for row in rows], pa.list_(pa.float32())),
        }
    )


def arithmetic_data(tokenizer, count: int) -> list:
    return [datum_from_tokens(r["model_input"], r["target_tokens"], r["weights"]) for r in arithmetic_rows(tokenizer, count)]
