"""What many short datums cost over the same tokens in few long ones: an RL batch's per-datum overhead.

Workload: one ``forward_backward`` (importance-sampling loss) of ``--datums`` datums of 16 tokens each, against the
same number of tokens as ``--datums / 16`` datums of 256 tokens (the baseline: the fewest datums that carry those
tokens). The model is a one-layer Llama with a 256-token vocabulary on the portable path (the path a GPU runs), so
the model's compute is small and what differs is the engine's work per datum (validation, packing, the loss, the
copies back). Sides alternate in one process, in a float32 and a bfloat16 engine (bf16 weights) in the same
run; each prints its median over ``--repeats`` calls after one warm-up. The headline is ``many short / few long``
in the dtype where the baseline (few long) is faster (1.0 = no per-datum overhead; ``measure.dtype_headline``).
Figures: docs/localtinker-gpu.md.

Usage: ``python bench/bench_many_datums.py [--datums 1024] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from localtinker.engine.api import DatumArrays, LoraSpec
from localtinker.engine.engine import LocalEngine
from measure import dtype_headline

SHORT, LONG = 16, 256


def rl_data(count: int, length: int, rng: np.random.Generator) -> list[DatumArrays]:
    data = []
    for _ in range(count):
        tokens = rng.integers(0, 256, size=length + 1)
        advantages = np.zeros(length, np.float32)
        advantages[length // 2 :] = rng.standard_normal()  # the second half sampled, the first an observation
        data.append(DatumArrays(tokens=tokens[:-1], loss_fn_inputs={
            "target_tokens": tokens[1:], "logprobs": np.full(length, -1.0, np.float32), "advantages": advantages}))
    return data


def main() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datums", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    rng = np.random.default_rng(0)
    sides = {"many short": rl_data(args.datums, SHORT, rng), "few long": rl_data(args.datums * SHORT // LONG, LONG, rng)}
    print(f"forward_backward of {args.datums * SHORT} tokens, portable path, 1 thread", flush=True)
    medians: dict[tuple[str, str], float] = {}
    for dtype, weights in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(weights).eval().requires_grad_(False)
        engine = LocalEngine(tempfile.mkdtemp(prefix="bench-many-datums-"), dtype=dtype, portable=True)
        engine.add_base_model("tiny-llama", model)
        engine.create_model("m", "tiny-llama", LoraSpec(rank=4, seed=0, train_unembed=False))
        times: dict[str, list[float]] = {side: [] for side in sides}
        for data in sides.values():  # warm-up
            engine.forward_backward("m", data, "importance_sampling", None, False)
        for _ in range(args.repeats):
            for side, data in sides.items():
                start = time.perf_counter()
                engine.forward_backward("m", data, "importance_sampling", None, False)
                times[side].append(time.perf_counter() - start)
        for side, data in sides.items():
            print(f"  {dtype}, {side}: {len(data)} datums, {statistics.median(times[side]) * 1e3:.0f} ms", flush=True)
        medians[("ours", dtype)] = statistics.median(times["many short"])
        medians[("baseline", dtype)] = statistics.median(times["few long"])
    print(dtype_headline(medians, "<= 1.25", cost=True), flush=True)


if __name__ == "__main__":
    main()
