"""Sampling throughput: localtinker's engine (bfloat16) vs ``model.generate`` under bf16 autocast.

Workload: SmolLM2-135M-Instruct, 32 distinct chat prompts (different lengths), 16 new tokens each,
temperature 1, no early stop (stop ids disabled) so both produce exactly 32 × 16 tokens. Baseline:
fp32 model, ``torch.autocast(bfloat16)``, one batched left-padded ``generate(do_sample=True)`` call;
ours: one ``sample_batch`` with the 32 requests. Both alternate in one process. Prints new tokens/s
and ``ratio = ours/baseline``; also the bf16 sampler-vs-trainer logprob agreement on the samples.

Usage: ``python bench/bench_engine_sample.py [--repeats 2]``
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from localtinker.engine.api import DatumArrays, LoraSpec, SampleSpec
from localtinker.engine.engine import LocalEngine
from localtinker.engine.packaged import SMOLLM2_NAME, smollm2_hf_dir

PROMPTS, NEW_TOKENS = 32, 16
TOPICS = ["the sea", "a cat", "prime numbers", "Paris", "rain", "a robot", "tea", "autumn"]


def prompts(tokenizer) -> list[list[int]]:
    texts = [f"Write {1 + i % 4} sentences about {TOPICS[i % len(TOPICS)]} (variant {i})." for i in range(PROMPTS)]
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for text in texts
    ]


class Baseline:
    def __init__(self, tokenizer) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir(), dtype=torch.float32).eval()
        self.tokenizer = tokenizer

    def run(self, prompt_tokens: list[list[int]]) -> int:
        width = max(len(p) for p in prompt_tokens)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompt_tokens])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_tokens])
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                do_sample=True,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                pad_token_id=pad,
                top_k=0,
            )
        return (out.shape[1] - width) * len(prompt_tokens)


class Ours:
    def __init__(self, storage: Path, dtype: str = "bfloat16") -> None:
        self.engine = LocalEngine(storage, dtype=dtype)
        self.engine.create_model("bench:train:0", SMOLLM2_NAME, LoraSpec(rank=16, seed=0))
        self.engine.create_ephemeral_sampler("bench:sample:0", "bench:train:0")
        self.last = None

    def run(self, prompt_tokens: list[list[int]]) -> int:
        specs = [
            SampleSpec(prompt_tokens=tuple(p), max_tokens=NEW_TOKENS, seed=i, stop_token_ids=())
            for i, p in enumerate(prompt_tokens)
        ]
        self.last = list(zip(prompt_tokens, self.engine.sample_batch([("bench:sample:0", s) for s in specs])))
        return sum(len(result.sequences[0].tokens) for _, result in self.last)

    def agreement(self) -> tuple[float, float]:
        """(mean, max) |sampler logprob − trainer logprob| over all sampled tokens."""
        gaps = []
        for prompt, result in self.last:
            sequence = result.sequences[0]
            full = list(prompt) + sequence.tokens
            datum = DatumArrays(
                tokens=np.array(full[:-1]),
                loss_fn_inputs={"target_tokens": np.array(full[1:]), "weights": np.ones(len(full) - 1, np.float32)},
            )
            trained = self.engine.forward_backward("bench:train:0", [datum], "cross_entropy", None, True)
            learner = trained.loss_fn_outputs[0]["logprobs"][-len(sequence.tokens) :]
            gaps.extend(np.abs(learner - np.array(sequence.logprobs)).tolist())
        return float(np.mean(gaps)), float(np.max(gaps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="engine dtype")
    # One thread by default: on this 2-core machine shared with other jobs, 2-thread runs mostly measure
    # OpenMP threads waiting for each other (both sides run 3-4x slower), not the engine.
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both sides (0 = torch default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir())
    prompt_tokens = prompts(tokenizer)
    with tempfile.TemporaryDirectory() as storage:
        ours_name = f"ours (LocalEngine {args.dtype})"
        runners = {"baseline (model.generate, bf16 autocast)": Baseline(tokenizer), ours_name: Ours(Path(storage), args.dtype)}
        for runner in runners.values():
            runner.run(prompt_tokens[:4])  # warm-up
        seconds = {name: 0.0 for name in runners}
        produced = {name: 0 for name in runners}
        for _ in range(args.repeats):
            for name, runner in runners.items():
                start = time.perf_counter()
                produced[name] += runner.run(prompt_tokens)
                seconds[name] += time.perf_counter() - start
        rates = {name: produced[name] / seconds[name] for name in runners}
        for name, rate in rates.items():
            print(f"{name}: {rate:.1f} new tokens/s ({produced[name]} tokens)")
        baseline, ours = rates.values()
        print(f"ratio = ours/baseline = {ours / baseline:.2f} (goal >= 2)")
        mean_gap, max_gap = runners[ours_name].agreement()
        print(f"{args.dtype} |sampler - trainer| logprob on sampled tokens: mean {mean_gap:.2e}, max {max_gap:.2e}")


if __name__ == "__main__":
    main()
