"""DPO step time through the tinker SDK + localtinker, against an SFT step and a plain DPO loop.

Workload: SmolLM2-135M-Instruct, 4 pairs = 8 sequences × 128 tokens (a 64-token prompt shared by both
sides, 64 completion tokens trained), LoRA rank 16 on all linear layers + the unembedding, one Adam
step per batch. Reference logprobs are computed once, before timing, on every side (as DPO does).

- ours DPO: ``forward_backward_custom(datums, dpo_loss_fn)`` + ``optim_step`` through the real SDK
  against an in-process localtinker server (the SDK's client-side custom loss: a forward, the loss
  locally, then a weighted cross-entropy forward_backward, which localtinker serves from the kept
  graph of that forward: a backward only);
- ours SFT: ``forward_backward(datums, "cross_entropy")`` + ``optim_step`` on the same tokens;
- baseline: the DPO loop a user would write with transformers + peft (policy forward, per-token
  logprobs, DPO loss, backward, ``torch.optim.AdamW``), in float32 and under bf16 autocast; the faster
  of the two is the baseline.

All runners alternate step by step in one process, so machine load hits them alike. Prints seconds per
step, ``dpo/sft`` (goal <= 1.6) and ``baseline/ours`` (goal >= 1.5).

Usage: ``python bench/bench_dpo.py [--steps 3] [--threads 1] [--dtype auto|float32|bfloat16]``
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import numpy as np
import tinker
import torch
import torch.nn.functional as F

from localtinker.engine.api import LoraSpec
from localtinker.engine.lora import target_module_names
from localtinker.engine.packaged import SMOLLM2_NAME, smollm2_hf_dir
from localtinker.server import start_server
from posttrain.preference.data import Pair, Side
from posttrain.preference.dpo import dpo_loss_fn
from posttrain.preference.reference import compute_reference_logprobs
from measure import Bf16Probe, server_bench_options

PAIRS, PROMPT, COMPLETION, RANK, BETA, LEARNING_RATE = 4, 64, 64, 16, 0.1, 1e-5


def make_pairs(seed: int) -> list[Pair]:
    rng = np.random.default_rng(seed)
    pairs = []
    for index in range(PAIRS):
        prompt = rng.integers(0, 49152, size=PROMPT).tolist()
        sides = []
        for _ in range(2):
            tokens = prompt + rng.integers(0, 49152, size=COMPLETION).tolist()
            weights = [0.0] * (PROMPT - 1) + [1.0] * COMPLETION
            sides.append(Side(tokens[:-1], tokens[1:], weights))
        pairs.append(Pair(f"bench{seed}-{index}", PROMPT, sides[0], sides[1]))
    return pairs


def pair_datums(pairs: list[Pair]) -> list[tinker.Datum]:
    return [datum for pair in pairs for datum in (pair.chosen.datum(), pair.rejected.datum())]


class Ours:
    """DPO and SFT steps on one training client of an in-process localtinker server."""

    def __init__(self, base_url: str, reference: dict[str, tuple[float, float]]):
        self.service = tinker.ServiceClient(base_url=base_url, api_key="tml-local")
        self.client = self.service.create_lora_training_client(base_model=SMOLLM2_NAME, rank=RANK, seed=0).result()
        self.reference = reference
        self.adam = tinker.AdamParams(learning_rate=LEARNING_RATE)

    def dpo_step(self, pairs: list[Pair]) -> None:
        chosen_ref = [self.reference[pair.row_id][0] for pair in pairs]
        rejected_ref = [self.reference[pair.row_id][1] for pair in pairs]
        step = self.client.forward_backward_custom(pair_datums(pairs), dpo_loss_fn(chosen_ref, rejected_ref, BETA))
        optim = self.client.optim_step(self.adam)
        step.result()
        optim.result()

    def sft_step(self, pairs: list[Pair]) -> None:
        step = self.client.forward_backward(pair_datums(pairs), "cross_entropy")
        optim = self.client.optim_step(self.adam)
        step.result()
        optim.result()


class Baseline:
    """A plain transformers + peft DPO loop (reference sums precomputed, like ours)."""

    def __init__(self, reference: dict[str, tuple[float, float]], autocast: bool):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir(), dtype=torch.float32)
        config = LoraConfig(r=RANK, lora_alpha=32, target_modules=target_module_names(LoraSpec(rank=RANK)))
        self.model = get_peft_model(model, config)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=LEARNING_RATE, betas=(0.9, 0.95), eps=1e-12
        )
        self.reference = reference
        self.autocast = autocast

    def dpo_step(self, pairs: list[Pair]) -> None:
        sides = [side for pair in pairs for side in (pair.chosen, pair.rejected)]
        inputs = torch.tensor([side.model_input for side in sides])
        targets = torch.tensor([side.target_tokens for side in sides])
        weights = torch.tensor([side.weights for side in sides])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(input_ids=inputs).logits
        logprobs = torch.gather(F.log_softmax(logits.float(), dim=-1), 2, targets.unsqueeze(-1)).squeeze(-1)
        sums = (logprobs * weights).sum(dim=1)
        reference = torch.tensor([value for pair in pairs for value in self.reference[pair.row_id]])
        ratios = sums - reference
        loss = -F.logsigmoid(BETA * (ratios[0::2] - ratios[1::2])).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def timed(step, pairs: list[Pair]) -> float:
    start = time.perf_counter()
    step(pairs)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = server_bench_options(parser)
    probe = Bf16Probe()
    print(probe.note(), flush=True)
    args.dtype = probe.engine_dtype(args.dtype)
    print(f"engine dtype: {args.dtype}", flush=True)
    batches = [make_pairs(seed) for seed in range(args.steps + 1)]
    with tempfile.TemporaryDirectory() as storage, start_server(storage, dtype=args.dtype) as server:
        service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-local")
        sampler = service.create_sampling_client(base_model=SMOLLM2_NAME).result()
        table = compute_reference_logprobs(sampler, [pair for batch in batches for pair in batch]).to_pydict()
        reference = dict(zip(table["row_id"], zip(table["chosen_ref_logprob_sum"], table["rejected_ref_logprob_sum"])))
        ours = Ours(server.base_url, reference)
        builders = {
            "ours DPO (SDK forward_backward_custom)": lambda: ours.dpo_step,
            "ours SFT (SDK forward_backward cross_entropy)": lambda: ours.sft_step,
            "baseline DPO float32 (transformers+peft)": lambda: Baseline(reference, autocast=False).dpo_step,
            "baseline DPO bf16 autocast (transformers+peft)": lambda: Baseline(reference, autocast=True).dpo_step,
        }
        runners = probe.build(builders)
        for step in runners.values():
            step(batches[0])  # warm-up
        seconds = {name: 0.0 for name in runners}
        for batch in batches[1:]:
            for name, step in runners.items():
                seconds[name] += timed(step, batch)
        ours.service.close("success").result(timeout=60)
        service.close("success").result(timeout=60)
    per_step = {name: value / args.steps for name, value in seconds.items()}
    for name, value in per_step.items():
        print(f"{name}: {value:.3f} s/step")
    dpo, sft, *baselines = per_step.values()
    print(f"dpo/sft = {dpo / sft:.2f} (goal <= 1.6)")
    print(f"baseline/ours = {min(baselines) / dpo:.2f} (faster baseline; goal >= 1.5)")


if __name__ == "__main__":
    main()
