"""Sampling throughput: localtinker's engine vs ``model.generate`` (float32 and bf16 autocast).

Workload: SmolLM2-135M-Instruct, 32 distinct chat prompts (different lengths), 16 new tokens each,
temperature 1, no early stop (stop ids disabled) so every side produces exactly 32 × 16 tokens.
Baselines: one batched left-padded ``generate(do_sample=True)`` call on the fp32 model, plain and
under ``torch.autocast(bfloat16)``; ours: one ``sample_batch`` with the 32 requests, engine float32
(the default) and bfloat16. All alternate in one process. Prints new tokens/s, achieved GFLOP/s of
the useful work (bench/measure.py) against a matmul peak measured in the run, and
``ratio = ours / the faster baseline``, ours in that baseline's precision (goal >= 1.5); also the sampler-vs-trainer logprob gap.

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
from measure import Bf16Probe, FlopModel, Peaks, headline_ratio

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
    def __init__(self, tokenizer, model, autocast: bool) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.autocast = autocast

    def run(self, prompt_tokens: list[list[int]]) -> int:
        width = max(len(p) for p in prompt_tokens)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompt_tokens])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_tokens])
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
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


def useful_flops(flop_model: FlopModel, prompt_tokens: list[list[int]]) -> float:
    """Prefill of the prompts, any prefix several of them share (their chat header, "Write 1 sentences about")
    once (``FlopModel.prompts_forward``), + NEW_TOKENS - 1 decode steps per prompt."""
    prefill = flop_model.prompts_forward(prompt_tokens)
    decode = sum(
        flop_model.forward(NEW_TOKENS - 1, sum(len(p) + i for i in range(1, NEW_TOKENS))) for p in prompt_tokens
    )
    return prefill + decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    # One thread by default: on this 2-core machine shared with other jobs, 2-thread runs mostly measure
    # OpenMP threads waiting for each other (both sides run 3-4x slower), not the engine.
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both sides (0 = torch default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir())
    prompt_tokens = prompts(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir(), dtype=torch.float32).eval()
    flops = useful_flops(FlopModel(model.config), prompt_tokens)
    probe = Bf16Probe()
    print(probe.note())
    with tempfile.TemporaryDirectory() as storage:
        builders = {
            "baseline generate float32": lambda: Baseline(tokenizer, model, autocast=False),
            "baseline generate bf16 autocast": lambda: Baseline(tokenizer, model, autocast=True),
            "ours LocalEngine float32": lambda: Ours(Path(storage) / "f32", "float32"),
            "ours LocalEngine bfloat16": lambda: Ours(Path(storage) / "bf16", "bfloat16"),
        }
        runners = probe.build(builders)
        for runner in runners.values():
            runner.run(prompt_tokens[:4])  # warm-up
        seconds = {name: 0.0 for name in runners}
        produced = {name: 0 for name in runners}
        for _ in range(args.repeats):
            for name, runner in runners.items():
                start = time.perf_counter()
                produced[name] += runner.run(prompt_tokens)
                seconds[name] += time.perf_counter() - start
        peaks = Peaks(probe)
        rates = {name: produced[name] / seconds[name] for name in runners}
        for name, rate in rates.items():
            print(f"{name}: {rate:.1f} new tokens/s ({produced[name]} tokens); {peaks.report(name, flops * args.repeats, seconds[name])}")
        print(headline_ratio(rates, ">= 1.5"))
        for name in ("ours LocalEngine float32", "ours LocalEngine bfloat16"):
            mean_gap, max_gap = runners[name].agreement()
            print(f"{name} |sampler - trainer| logprob on sampled tokens: mean {mean_gap:.2e}, max {max_gap:.2e}")


if __name__ == "__main__":
    main()
