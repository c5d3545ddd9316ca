"""One GRPO step: our stack (RLRecipe over the tinker SDK, embedded localtinker) vs a transformers+peft loop.

Workload, identical on both sides: SmolLM2-135M-Instruct with LoRA rank 16 on every linear layer and the
unembedding; each step = 16 arithmetic problems ("What is x + y?", the cookbook's env) × a group of 4
samples = 64 samples of at most 16 new tokens at temperature 1 over the full distribution; each sample
graded by the same reward function (``ProblemEnv.step``); advantages R − mean(R) per group; every sample
trained with the importance-sampling loss −Σ exp(lp − q)·A summed over sampled tokens; one Adam step.
Both sides see the same prompt token ids (the chatml renderer's generation prompts of batch k).

- ours: ``RLRecipe`` (sync driver) ``submit_step(k).result()`` through the real tinker SDK against
  localtinker started in this process (``--dtype`` engine), i.e. publish a sampler on the current
  weights, roll out the groups (one ``num_samples=G`` request per problem), score, ``forward_backward``,
  ``optim_step``.
- baseline: the loop a user writes with transformers + peft: one ``model.generate`` over the 16
  left-padded prompts with ``num_return_sequences=G`` (sampler logprobs from ``output_scores``), score,
  one forward over prompt+completion keeping only the completion logits, the same loss, ``AdamW``.
  Timed in float32 and under ``torch.autocast(bfloat16)``; the ratio divides by the faster of the two.

The sides run one after the other (never at the same time), each in turn built, warmed up with one
step, timed for ``--repeats`` steps and dropped (three resident at once exceed this machine's memory);
each reports the median step and its split into sampling, scoring and training. Torch uses every core (``--threads``, default ``os.cpu_count()``).

Usage: ``python bench/bench_rl_step.py [--repeats 3] [--group-size 4] [--dtype auto|float32|bfloat16]``
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import tinker
import torch

from localtinker.engine.api import LoraSpec
from localtinker.engine.lora import target_module_names
from localtinker.engine.packaged import SMOLLM2_NAME, smollm2_hf_dir
from localtinker.server import build_engine, start_server
from posttrain.renderers import get_renderer
from posttrain.rl.config import RLConfig
from posttrain.rl.envs.arithmetic import ArithmeticDataset
from posttrain.rl.recipe import RLRecipe
from posttrain.rl.types import Env, EnvGroupBuilder, RLDataset, StepResult
from posttrain.training.config import TrainingConfig
from measure import Bf16Probe

RANK = 16
LEARNING_RATE = 4e-5
ADAM = dict(betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)  # tinker.AdamParams' defaults
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


@dataclass
class StepTimes:
    sampling: float
    scoring: float
    training: float
    total: float
    samples: int
    new_tokens: int
    mean_reward: float


@dataclass
class ScoringClock:
    """Summed seconds spent in reward code (env.step, compute_group_rewards), from any thread."""

    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds

    def take(self) -> float:
        with self._lock:
            seconds, self.seconds = self.seconds, 0.0
        return seconds


class TimedEnv(Env):
    def __init__(self, inner: Env, clock: ScoringClock):
        self.inner = inner
        self.clock = clock

    def initial_observation(self):
        return self.inner.initial_observation()

    def step(self, action) -> StepResult:
        start = time.perf_counter()
        try:
            return self.inner.step(action)
        finally:
            self.clock.add(time.perf_counter() - start)


class TimedGroup(EnvGroupBuilder):
    def __init__(self, inner: EnvGroupBuilder, clock: ScoringClock):
        self.inner = inner
        self.clock = clock

    def make_envs(self) -> Sequence[Env]:
        return [TimedEnv(env, self.clock) for env in self.inner.make_envs()]

    def compute_group_rewards(self, trajectories, envs):
        start = time.perf_counter()
        try:
            return self.inner.compute_group_rewards(trajectories, [env.inner for env in envs])
        finally:
            self.clock.add(time.perf_counter() - start)

    def trajectory_logs(self, envs):
        return self.inner.trajectory_logs([env.inner for env in envs])

    def logging_tags(self) -> list[str]:
        return self.inner.logging_tags()


class TimedDataset(RLDataset):
    """The arithmetic dataset with its reward code timed, so ours can split rollout time into sampling and scoring."""

    def __init__(self, inner: RLDataset, clock: ScoringClock):
        self.inner = inner
        self.clock = clock

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        return [TimedGroup(builder, self.clock) for builder in self.inner.get_batch(index)]

    def __len__(self) -> int:
        return len(self.inner)


class Ours:
    """RLRecipe.submit_step on a training client of the embedded localtinker, through the tinker SDK."""

    def __init__(self, storage: Path, dtype: str, threads: int, dataset: RLDataset, group_size: int, groups: int, max_tokens: int):
        self.server = start_server(storage, engine=build_engine(storage, dtype, num_threads=threads))
        self.service = tinker.ServiceClient(base_url=self.server.base_url, api_key="tml-local")
        self.training_client = self.service.create_lora_training_client(base_model=SMOLLM2_NAME, rank=RANK, seed=0).result()
        self.clock = ScoringClock()
        config = RLConfig(
            training=TrainingConfig(base_model=SMOLLM2_NAME, lora_rank=RANK, learning_rate=LEARNING_RATE, log_dir=str(storage / "run")),
            group_size=group_size,
            groups_per_batch=groups,
            max_tokens=max_tokens,
            num_batches=len(dataset),
            remove_constant_reward_groups=False,  # train on all 64 samples, as the baseline does
        )
        self.recipe = RLRecipe(config, TimedDataset(dataset, self.clock), self.training_client.get_tokenizer())
        self.recipe.start(self.training_client, self.service, 0)
        self.adam = tinker.AdamParams(learning_rate=LEARNING_RATE)

    def step(self, index: int) -> StepTimes:
        self.clock.take()
        start = time.monotonic()
        outcome = self.recipe.submit_step(index, self.training_client, self.adam).result()
        total = time.monotonic() - start
        metrics = outcome.metrics
        scoring = self.clock.take()
        publish = total - metrics["time/training_s"]  # save_weights_for_sampler + sampling client, before rollouts
        rollout = metrics["time/sampling_s"]
        return StepTimes(
            sampling=publish + rollout - scoring,
            scoring=scoring,
            training=metrics["time/training_s"] - rollout,
            total=total,
            samples=len(outcome.rows),
            new_tokens=int(metrics["num_action_tokens"]),
            mean_reward=metrics["reward/mean"],
        )

    def close(self) -> None:
        self.recipe.close()
        self.service.close("success").result(timeout=60)
        self.server.stop()


class Baseline:
    """The GRPO step a user writes with transformers ``generate`` + peft LoRA + a manual IS loss + AdamW."""

    def __init__(self, tokenizer, dataset: RLDataset, group_size: int, max_tokens: int, autocast: bool):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir(), dtype=torch.float32)
        lora = LoraConfig(r=RANK, lora_alpha=32, target_modules=target_module_names(LoraSpec(rank=RANK)))
        self.model = get_peft_model(model, lora)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=LEARNING_RATE, **ADAM)
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.group_size = group_size
        self.max_tokens = max_tokens
        self.autocast = autocast
        self.stop_ids = sorted({tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id})

    def precision(self):
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else nullcontext()

    def step(self, index: int) -> StepTimes:
        start = time.monotonic()
        envs_P = [builder.make_envs() for builder in self.dataset.get_batch(index)]
        prompts_P = [list(envs[0].initial_observation()[0].to_ints()) for envs in envs_P]
        completions_N, logprobs_N, prompt_ids, prompt_mask = self.sample(prompts_P)
        sampled = time.monotonic()
        rewards_N = [envs[g].step(completions_N[p * self.group_size + g]).reward for p, envs in enumerate(envs_P) for g in range(self.group_size)]
        rewards_PG = np.asarray(rewards_N, dtype=np.float64).reshape(len(prompts_P), self.group_size)
        advantages_N = (rewards_PG - rewards_PG.mean(axis=1, keepdims=True)).reshape(-1)
        scored = time.monotonic()
        self.train(prompt_ids, prompt_mask, completions_N, logprobs_N, advantages_N)
        end = time.monotonic()
        return StepTimes(
            sampling=sampled - start,
            scoring=scored - sampled,
            training=end - scored,
            total=end - start,
            samples=len(completions_N),
            new_tokens=sum(len(c) for c in completions_N),
            mean_reward=float(rewards_PG.mean()),
        )

    def sample(self, prompts_P: list[list[int]]):
        width = max(len(p) for p in prompts_P)
        pad = self.tokenizer.pad_token_id
        prompt_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts_P])
        prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts_P])
        self.model.eval()
        with torch.inference_mode(), self.precision():
            out = self.model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=self.max_tokens,
                num_return_sequences=self.group_size,
                eos_token_id=self.stop_ids,
                pad_token_id=pad,
                output_scores=True,
                return_dict_in_generate=True,
            )
        new_tokens = out.sequences[:, width:]
        step_logprobs = torch.stack([torch.log_softmax(score.float(), dim=-1) for score in out.scores], dim=1)
        token_logprobs = step_logprobs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        completions, logprobs = [], []
        for row, row_logprobs in zip(new_tokens.tolist(), token_logprobs.tolist()):
            length = next((i + 1 for i, token in enumerate(row) if token in self.stop_ids), len(row))
            completions.append(row[:length])
            logprobs.append(row_logprobs[:length])
        # generate repeats each prompt group_size times in a row: rows p*G .. p*G+G-1 belong to prompt p
        return completions, logprobs, prompt_ids.repeat_interleave(self.group_size, 0), prompt_mask.repeat_interleave(self.group_size, 0)

    def train(self, prompt_ids, prompt_mask, completions_N, logprobs_N, advantages_N) -> None:
        width = max(len(c) for c in completions_N)
        pad = self.tokenizer.pad_token_id
        completion_ids = torch.tensor([c + [pad] * (width - len(c)) for c in completions_N])
        completion_mask = torch.tensor([[1.0] * len(c) + [0.0] * (width - len(c)) for c in completions_N])
        sampler_logprobs = torch.tensor([q + [0.0] * (width - len(q)) for q in logprobs_N])
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask.long()], dim=1)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        self.model.train()
        with self.precision():
            logits = self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=width + 1
            ).logits[:, :-1]
        learner_logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(learner_logprobs - sampler_logprobs)
        advantages = torch.tensor(advantages_N, dtype=torch.float32).unsqueeze(1)
        loss = -(ratio * advantages * completion_mask).sum()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def machine_state() -> str:
    flags: set[str] = set()
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    present = ", ".join(f"{flag}={'yes' if flag in flags else 'no'}" for flag in CPU_FLAGS)
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    return f"cpus={os.cpu_count()} load average (1/5/15 min)={load}; {present}; torch {torch.__version__}"


def run_side(name: str, side: Ours | Baseline, repeats: int) -> list[StepTimes]:
    """Warm-up step 0, then steps 1..repeats; the side is then dropped and its memory handed back, so
    only one side's model, optimizer and activations are ever resident (three at once do not fit here)."""
    try:
        progress(name, 0, side.step(0))
        return [progress(name, index, side.step(index)) for index in range(1, repeats + 1)]
    finally:
        if isinstance(side, Ours):
            side.close()
        del side
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def progress(name: str, index: int, times: StepTimes) -> StepTimes:
    label = "warm-up" if index == 0 else f"step {index}"
    print(f"  {label} {name.split(' (')[0]}: {times.total:.2f} s", file=sys.stderr, flush=True)
    return times


def summarize(name: str, steps: list[StepTimes]) -> float:
    median = {part: statistics.median(getattr(s, part) for s in steps) for part in ("sampling", "scoring", "training", "total")}
    tokens = statistics.median(s.new_tokens for s in steps)
    print(
        f"{name}: median step {median['total']:.2f} s = sampling {median['sampling']:.2f} + scoring "
        f"{median['scoring'] * 1e3:.1f} ms + training {median['training']:.2f} s "
        f"(steps {', '.join(f'{s.total:.2f}' for s in steps)} s; {steps[0].samples} samples, median {tokens:.0f} new tokens, "
        f"mean reward {statistics.mean(s.mean_reward for s in steps):+.3f})"
    )
    return median["total"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per side (after one warm-up step)")
    parser.add_argument("--groups", type=int, default=16, help="problems per step")
    parser.add_argument("--group-size", type=int, default=4, help="samples per problem")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="localtinker engine dtype; auto = bfloat16 where bf16 is native here, else float32 (the product default)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads, for every side")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir())
    dataset = ArithmeticDataset(
        get_renderer("chatml", tokenizer), group_size=args.group_size, groups_per_batch=args.groups, num_batches=args.repeats + 1, seed=0
    )
    print(f"machine before: {machine_state()}; torch threads {torch.get_num_threads()}")
    probe = Bf16Probe()
    print(probe.note())
    args.dtype = probe.engine_dtype(args.dtype)
    print(f"workload: {args.groups} problems x group {args.group_size} = {args.groups * args.group_size} samples, "
          f"<= {args.max_tokens} new tokens, LoRA rank {RANK}, SmolLM2-135M-Instruct")
    timed: dict[str, list[StepTimes]] = {}
    with tempfile.TemporaryDirectory() as storage:
        sides = {
            f"ours (RLRecipe -> tinker SDK -> localtinker {args.dtype})": lambda: Ours(
                Path(storage), args.dtype, args.threads, dataset, args.group_size, args.groups, args.max_tokens
            ),
            "baseline float32 (generate + peft + AdamW)": lambda: Baseline(tokenizer, dataset, args.group_size, args.max_tokens, autocast=False),
            "baseline bf16 autocast (generate + peft + AdamW)": lambda: Baseline(tokenizer, dataset, args.group_size, args.max_tokens, autocast=True),
        }
        for name, build in probe.select(sides).items():
            timed[name] = run_side(name, build(), args.repeats)
    medians = {name: summarize(name, steps) for name, steps in timed.items()}
    ours_name, *baseline_names = medians
    faster = min(baseline_names, key=medians.get)
    print(f"ratio = faster baseline ({faster.split(' (')[0]}) / ours = {medians[faster] / medians[ours_name]:.2f} (goal >= 2)")
    print(f"machine after: {machine_state()}")


if __name__ == "__main__":
    main()
