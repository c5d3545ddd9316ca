"""LoRA SFT step throughput on equal-length rows: localtinker's engine vs a plain transformers+peft loop.

Workload: SmolLM2-135M-Instruct, 8 sequences × 128 tokens, every position weighted, LoRA rank 16
on all linear layers + the unembedding, one AdamW step per batch. Baselines: the simple loop a user
would write (fp32 model + peft, ``model(input_ids, labels=...)``, ``torch.optim.AdamW``), plain float32
and under ``torch.autocast(bfloat16)``. Ours: ``LocalEngine`` float32 (the default) and bfloat16. All
run in this process, alternating, so machine load hits them alike. Prints tokens/s, GFLOP/s against a
matmul peak measured in the run (bench/measure.py), and ``ratio = ours / the faster baseline``, ours in
that baseline's precision (float32, or bfloat16 where native bf16 makes autocast the faster baseline).
Variable-length chat batches: bench_engine_sft_varlen.py.

Usage: ``python bench/bench_engine_train.py [--steps 3]``
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

BATCH, LENGTH, RANK = 8, 128, 16


def make_batch(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 49152, size=(BATCH, LENGTH + 1))


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

    def step(self, batch: np.ndarray) -> None:
        input_ids = torch.as_tensor(batch[:, :-1])
        labels = torch.as_tensor(batch[:, :-1])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.model(input_ids=input_ids, labels=labels).loss * (BATCH * LENGTH)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


class Ours:
    def __init__(self, storage: Path, dtype: str = "bfloat16") -> None:
        self.engine = LocalEngine(storage, dtype=dtype)
        self.engine.create_model("bench:train:0", SMOLLM2_NAME, LoraSpec(rank=RANK, seed=0))

    def step(self, batch: np.ndarray) -> None:
        data = [
            DatumArrays(
                tokens=row[:-1],
                loss_fn_inputs={"target_tokens": row[1:], "weights": np.ones(LENGTH, dtype=np.float32)},
            )
            for row in batch
        ]
        self.engine.forward_backward("bench:train:0", data, "cross_entropy", None, forward_only=False)
        self.engine.optim_step("bench:train:0", AdamSpec(learning_rate=1e-4))


def timed(step, batch: np.ndarray) -> float:
    start = time.perf_counter()
    step(batch)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    # One thread by default: on this 2-core machine shared with other jobs, 2-thread runs mostly measure
    # OpenMP threads waiting for each other (both sides run 3-4x slower), not the engine.
    parser.add_argument("--threads", type=int, default=1, help="torch threads for every side (0 = torch default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    from transformers import AutoConfig

    flop_model = FlopModel(AutoConfig.from_pretrained(smollm2_hf_dir()))
    probe = Bf16Probe()
    print(probe.note())
    with tempfile.TemporaryDirectory() as storage:
        builders = {
            "baseline transformers+peft float32": lambda: Baseline(autocast=False),
            "baseline transformers+peft bf16 autocast": lambda: Baseline(autocast=True),
            "ours LocalEngine float32": lambda: Ours(Path(storage) / "f32", dtype="float32"),
            "ours LocalEngine bfloat16": lambda: Ours(Path(storage) / "bf16", dtype="bfloat16"),
        }
        runners = probe.build(builders)
        for runner in runners.values():
            runner.step(make_batch(0))  # warm-up
        seconds = {name: 0.0 for name in runners}
        for step in range(args.steps):
            for name, runner in runners.items():
                seconds[name] += timed(runner.step, make_batch(step + 1))
    peaks = Peaks(probe)
    tokens = args.steps * BATCH * LENGTH
    flops = args.steps * BATCH * 2 * flop_model.forward(LENGTH, flop_model.causal_keys(LENGTH))
    rates = {name: tokens / value for name, value in seconds.items()}
    for name, rate in rates.items():
        print(f"{name}: {rate:.1f} tokens/s; {peaks.report(name, flops, seconds[name])}")
    print(headline_ratio(rates, ">= 1.2"))


if __name__ == "__main__":
    main()
