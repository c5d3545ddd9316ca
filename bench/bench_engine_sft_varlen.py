"""LoRA SFT on variable-length chat batches: real (non-padding) tokens/s, engine vs a padding loop.

Workload: SmolLM2-135M-Instruct, LoRA rank 16 on every linear layer + the unembedding, steps of 16
sequences whose lengths follow chat SFT data (log-normal, median ~150 tokens, clipped to 20..512),
every token weighted, one AdamW step per batch. Baseline: the plain transformers+peft loop a user
writes (``per_device_batch_size=4`` with 4 accumulation steps: each micro-batch of 4 consecutive rows
padded to its longest, pads masked and labelled -100), float32 and under bf16 autocast; ours: one
``forward_backward`` of the 16 datums + ``optim_step`` on ``LocalEngine`` float32 (the default),
which orders rows by length before micro-batching so it computes little padding. Prints real
tokens/s, padding computed, GFLOP/s of the real work against a matmul peak measured in the run, and
``ratio = ours / the faster baseline`` (goal >= 1.5).

Usage: ``python bench/bench_engine_sft_varlen.py [--steps 2]``
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

from localtinker.engine.api import AdamSpec, DatumArrays, LoraSpec
from localtinker.engine.engine import LocalEngine
from localtinker.engine.lora import target_module_names
from localtinker.engine.packaged import SMOLLM2_NAME, smollm2_hf_dir
from measure import Bf16Probe, FlopModel, Peaks, headline_ratio

BATCH, MICRO_BATCH, RANK = 16, 4, 16
MIN_LENGTH, MAX_LENGTH = 20, 512


def make_batch(seed: int) -> list[np.ndarray]:
    """Token rows (length + 1 each: inputs and shifted targets) with chat-like lengths."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=np.log(150), sigma=0.7, size=BATCH), MIN_LENGTH, MAX_LENGTH).astype(int)
    return [rng.integers(0, 49152, size=length + 1) for length in lengths]


class Baseline:
    def __init__(self, autocast: bool) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir(), dtype=torch.float32)
        config = LoraConfig(r=RANK, lora_alpha=32, target_modules=target_module_names(LoraSpec(rank=RANK)))
        self.model = get_peft_model(model, config)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95), eps=1e-12
        )
        self.autocast = autocast
        self.computed_tokens = 0

    def step(self, rows: list[np.ndarray]) -> None:
        for start in range(0, len(rows), MICRO_BATCH):
            micro = rows[start : start + MICRO_BATCH]
            width = max(len(row) - 1 for row in micro)
            input_ids = torch.zeros((len(micro), width), dtype=torch.long)
            labels = torch.full((len(micro), width), -100, dtype=torch.long)
            mask = torch.zeros((len(micro), width), dtype=torch.long)
            for i, row in enumerate(micro):
                length = len(row) - 1
                input_ids[i, :length] = torch.as_tensor(row[:-1])
                labels[i, :length] = torch.as_tensor(row[:-1])
                mask[i, :length] = 1
            self.computed_tokens += input_ids.numel()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                out = self.model(input_ids=input_ids, attention_mask=mask, labels=labels)
            (out.loss * int((labels[:, 1:] != -100).sum())).backward()  # token sums, like the engine
        self.optimizer.step()
        self.optimizer.zero_grad()


class Ours:
    def __init__(self, storage: Path, dtype: str) -> None:
        self.engine = LocalEngine(storage, dtype=dtype)
        self.engine.create_model("bench:train:0", SMOLLM2_NAME, LoraSpec(rank=RANK, seed=0))

    def step(self, rows: list[np.ndarray]) -> None:
        data = [
            DatumArrays(tokens=row[:-1], loss_fn_inputs={"target_tokens": row[1:], "weights": np.ones(len(row) - 1, np.float32)})
            for row in rows
        ]
        self.engine.forward_backward("bench:train:0", data, "cross_entropy", None, forward_only=False)
        self.engine.optim_step("bench:train:0", AdamSpec(learning_rate=1e-4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for every side (0 = torch default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    from transformers import AutoConfig

    flop_model = FlopModel(AutoConfig.from_pretrained(smollm2_hf_dir()))
    probe = Bf16Probe()
    print(probe.note())
    batches = [make_batch(step + 1) for step in range(args.steps)]
    real_tokens = sum(len(row) - 1 for batch in batches for row in batch)
    flops = sum(2 * flop_model.forward(len(r) - 1, flop_model.causal_keys(len(r) - 1)) for b in batches for r in b)
    with tempfile.TemporaryDirectory() as storage:
        builders = {
            "baseline transformers+peft float32": lambda: Baseline(autocast=False),
            "baseline transformers+peft bf16 autocast": lambda: Baseline(autocast=True),
            "ours LocalEngine float32": lambda: Ours(Path(storage) / "f32", "float32"),
        }
        if probe.engine_dtype("auto") == "bfloat16":  # native bf16: the autocast baseline is ours' match
            builders["ours LocalEngine bfloat16"] = lambda: Ours(Path(storage) / "bf16", "bfloat16")
        runners = probe.build(builders)
        for runner in runners.values():
            runner.step(make_batch(0))  # warm-up
        baseline_runner = runners["baseline transformers+peft float32"]
        baseline_runner.computed_tokens = 0
        seconds = {name: 0.0 for name in runners}
        for batch in batches:
            for name, runner in runners.items():
                start = time.perf_counter()
                runner.step(batch)
                seconds[name] += time.perf_counter() - start
    peaks = Peaks(probe)
    print(f"{real_tokens} real tokens in {args.steps} steps of {BATCH} rows")
    rates = {name: real_tokens / value for name, value in seconds.items()}
    for name, rate in rates.items():
        print(f"{name}: {rate:.1f} real tokens/s; {peaks.report(name, flops, seconds[name])}")
    print(f"baseline computes {baseline_runner.computed_tokens / real_tokens - 1:.0%} padding on top of the real tokens")
    print(headline_ratio(rates, ">= 1.5"))


if __name__ == "__main__":
    main()
