"""Rendering a 10,000-conversation SFT dataset to token rows: batch renderer vs per-message loop.

Workload: 10,000 generated chat conversations (a system prompt, 1-3 user/assistant exchanges, 5-120
words per message, some unicode), rendered with the ``chatml`` renderer on SmolLM2's tokenizer to
Arrow rows (tokens + per-token weights, last assistant message trained).

Baseline: how tinker-cookbook renders, i.e. a Python loop with one tokenizer call per message (the
message's header + content + end marker encoded together, special-token text recognised) and its
weights appended, then the same Arrow table. Ours: ``render_supervised_batch`` (every content of the
whole dataset in one batched tokenizer call, template pieces encoded once) then ``to_arrow()``.
Prints rows/s for both and ``ratio = ours/baseline`` (goal >= 3x), best of ``--repeats`` runs each,
alternating so machine load hits both alike. Also checks the two produce the same text.

Usage: ``python bench/bench_render.py [--rows 10000] [--repeats 2]``
"""

from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import numpy as np
import pyarrow as pa
from transformers import AutoTokenizer

from localtinker.engine.packaged import smollm2_hf_dir
from posttrain.renderers import TrainOnWhat, get_renderer
from posttrain.renderers.batch import render_supervised_batch

WORDS = (
    "the a model learns to answer questions about data training loss gradient token sequence batch "
    "python function returns value list café naïve 世界 数据 résumé 42 3.14 (x + y) * 2 = z; "
    "however therefore because although quickly carefully"
).split()


def make_dataset(rows: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120)))

    dataset = []
    for _ in range(rows):
        conversation = [{"role": "system", "content": text()}]
        for _ in range(rng.randint(1, 3)):
            conversation += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        dataset.append(conversation)
    return dataset


def to_table(tokens: list[list[int]], weights: list[np.ndarray]) -> pa.Table:
    return pa.table(
        {
            "tokens": pa.array(tokens, pa.list_(pa.int32())),
            "weights": pa.array([w.tolist() for w in weights], pa.list_(pa.float32())),
        }
    )


def baseline(tokenizer, dataset: list[list[dict]]) -> pa.Table:
    """One tokenizer call per message in a Python loop, as the cookbook's renderers do."""
    all_tokens, all_weights = [], []
    for conversation in dataset:
        tokens: list[int] = []
        weights: list[float] = []
        for index, message in enumerate(conversation):
            encoded = tokenizer.encode(
                f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n", add_special_tokens=False
            )
            trained = 1.0 if index == len(conversation) - 1 else 0.0
            tokens += encoded
            weights += [trained] * len(encoded)
        all_tokens.append(tokens)
        all_weights.append(np.asarray(weights, dtype=np.float32))
    return to_table(all_tokens, all_weights)


def ours(renderer, dataset: list[list[dict]]) -> pa.Table:
    return render_supervised_batch(renderer, dataset, TrainOnWhat.LAST_ASSISTANT_MESSAGE).to_arrow()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir())
    renderer = get_renderer("chatml", tokenizer)
    dataset = make_dataset(args.rows)

    ours_table, baseline_table = ours(renderer, dataset[:50]), baseline(tokenizer, dataset[:50])
    decode = tokenizer.decode
    assert [decode(t) for t in ours_table.column("tokens").to_pylist()] == [
        decode(t) for t in baseline_table.column("tokens").to_pylist()
    ], "the two paths render different text"

    best = {"baseline": float("inf"), "ours": float("inf")}
    for _ in range(args.repeats):
        for name, run in (("baseline", lambda: baseline(tokenizer, dataset)), ("ours", lambda: ours(renderer, dataset))):
            start = time.perf_counter()
            table = run()
            best[name] = min(best[name], time.perf_counter() - start)
            assert table.num_rows == args.rows
    rates = {name: args.rows / seconds for name, seconds in best.items()}
    tokens = sum(len(row) for row in ours_table.column("tokens").to_pylist()) * args.rows // 50
    print(f"dataset: {args.rows} conversations, ~{tokens:,} tokens, chatml on SmolLM2's tokenizer")
    print(f"baseline (one tokenizer call per message): {rates['baseline']:,.0f} rows/s")
    print(f"ours (render_supervised_batch):            {rates['ours']:,.0f} rows/s")
    print(f"ratio = {rates['ours'] / rates['baseline']:.2f}x  (goal >= 3x)")


if __name__ == "__main__":
    main()
