"""Multi-turn sampling through the SDK: 32 conversations × 5 turns, each turn sending the whole conversation.

Workload: SmolLM2-135M-Instruct behind an in-process localtinker, 32 episodes of a number-guessing game
(a shared ~70-token system prompt, then per episode its own question), 24 new tokens per turn, no early
stop; after each turn the episode's next prompt is its last prompt + the sampled tokens + a user reply
("Too low. Guess again." as a chat turn), as a multi-turn RL environment builds it. Each turn's 32
requests go at once (an RL loop's episodes in step). Sides, one after the other in one process:

- ours: the default server, whose prefix store (``localtinker/engine/prefix_store.py``) keeps each
  prompt and each continuation's samples, so a turn prefills only the last sampled token and the reply;
- ours with the prefix store off (``LOCALTINKER_PREFIX_CACHE_TOKENS=0``): every turn prefills the whole
  conversation (once per episode); the two server sides run twice each (A B B A), the faster run counts;
- baseline: ``model.generate`` over the 32 conversations per turn (left-padded), float32 and bf16
  autocast, the faster counting — what a plain loop does.

Prints per-turn seconds, new tokens/s, achieved GFLOP/s of the useful work (each turn's new positions
only: the conversation so far was computed at an earlier turn) against a matmul peak (``torch.mm`` or
oneDNN packed, the faster) measured in the run, the server's prefilled and reused prompt tokens, and the
ratios ours / faster baseline and ours / ours with the store off. No goal in the issue; reported.

Usage: ``python bench/bench_multiturn_sampling.py [--threads 1] [--episodes 32] [--turns 5]``
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker
import torch
from tinker import types

from localtinker.engine.packaged import SMOLLM2_NAME, smollm2_hf_dir
from localtinker.engine.prefix_store import ENV_BUDGET
from localtinker.server import start_server
from measure import Bf16Probe, FlopModel, Peaks, server_bench_options

EPISODES, TURNS, NEW_TOKENS = 32, 5, 24
SYSTEM = ("You are playing a number guessing game. The user has picked a whole number in a range and will tell "
          "you after each guess whether it was too low or too high. Answer with one number and a short reason, "
          "and use what you learned from every earlier reply.")
PARAMS = types.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, stop=[])

Conversations = list[list[int]]
Sampler = Callable[[Conversations, int], Conversations]  # (prompts, turn) -> one completion per prompt


def first_prompts(tokenizer, count: int) -> Conversations:
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": f"I picked a number from 1 to {100 + 37 * episode}. Your first guess?"}],
                add_generation_prompt=True, tokenize=False,
            ),
            add_special_tokens=False,
        )
        for episode in range(count)
    ]


def reply(tokenizer, episode: int, turn: int) -> list[int]:
    """The user's answer to a guess, as the tokens a chat template puts after an assistant turn."""
    verdict = "Too low" if (episode + turn) % 2 else "Too high"
    return tokenizer.encode(f"<|im_end|>\n<|im_start|>user\n{verdict}. Guess again.<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False)


def play(sample: Sampler, tokenizer, firsts: Conversations, turns: int) -> tuple[list[float], Conversations]:
    """Runs every episode for ``turns`` turns; returns (seconds per turn, the last prompts)."""
    prompts, seconds = [list(p) for p in firsts], []
    for turn in range(turns):
        start = time.perf_counter()
        completions = sample(prompts, turn)
        seconds.append(time.perf_counter() - start)
        if turn + 1 < turns:
            prompts = [p + c + reply(tokenizer, e, turn) for e, (p, c) in enumerate(zip(prompts, completions))]
    return seconds, prompts


def sdk_sampler(sampler) -> Sampler:
    def sample(prompts: Conversations, turn: int) -> Conversations:
        futures = [
            sampler.sample(types.ModelInput.from_ints(p), num_samples=1,
                           sampling_params=PARAMS.model_copy(update={"seed": 1000 * turn + e}))
            for e, p in enumerate(prompts)
        ]
        return [list(f.result().sequences[0].tokens) for f in futures]

    return sample


def generate_sampler(model, pad: int, autocast: bool) -> Sampler:
    def sample(prompts: Conversations, turn: int) -> Conversations:
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, pad_token_id=pad, top_k=0)
        return [row.tolist() for row in out[:, width:]]

    return sample


def useful_flops(flop_model: FlopModel, tokenizer, firsts: Conversations, turns: int) -> float:
    """Turn 1: the first prompts (their shared system prompt once, ``FlopModel.prompts_forward``); every
    later turn: only the positions no earlier turn computed (the last sampled token and the reply); each
    turn: NEW_TOKENS - 1 decode steps per episode. Lengths do not depend on which tokens were sampled."""
    total = flop_model.prompts_forward(firsts)
    lengths = [len(p) for p in firsts]
    for turn in range(turns):
        for episode, length in enumerate(lengths):
            if turn:
                new = 1 + len(reply(tokenizer, episode, turn - 1))
                first_new = length - new
                total += flop_model.forward(new, sum(range(first_new + 1, length + 1)), unembedded=1)
            total += flop_model.forward(NEW_TOKENS - 1, sum(range(length + 1, length + NEW_TOKENS)))
        if turn + 1 < turns:
            lengths = [length + NEW_TOKENS + len(reply(tokenizer, e, turn)) for e, length in enumerate(lengths)]
    return total


def run_server_side(dtype: str, store_tokens: str | None, tokenizer, firsts: Conversations,
                    turns: int) -> tuple[list[float], str]:
    """Plays on a fresh in-process server (the prefix store's budget from ``store_tokens``, None = default)."""
    previous = os.environ.pop(ENV_BUDGET, None)
    if store_tokens is not None:
        os.environ[ENV_BUDGET] = store_tokens
    try:
        with tempfile.TemporaryDirectory() as storage, start_server(storage, dtype=dtype) as server:
            client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-bench")
            sampler = client.create_sampling_client(base_model=SMOLLM2_NAME).result()
            warm = [list(range(1000 + 40 * i, 1040 + 40 * i)) for i in range(4)]  # not a prefix of any prompt
            sdk_sampler(sampler)(warm, 0)
            stats = server.service.worker.sampling_stats
            before = (stats.prefill_tokens, stats.reused_prefix_tokens)
            seconds, _ = play(sdk_sampler(sampler), tokenizer, firsts, turns)
            counts = (f"prompt tokens prefilled {stats.prefill_tokens - before[0]}, "
                      f"reused from the prefix store {stats.reused_prefix_tokens - before[1]}")
            client.close("success").result()
            return seconds, counts
    finally:
        os.environ.pop(ENV_BUDGET, None)
        if previous is not None:
            os.environ[ENV_BUDGET] = previous


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=EPISODES)
    parser.add_argument("--turns", type=int, default=TURNS)
    args = server_bench_options(parser)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir())
    firsts = first_prompts(tokenizer, args.episodes)
    probe = Bf16Probe()
    print(probe.note())
    dtype = probe.engine_dtype(args.dtype)
    print(f"engine dtype: {dtype}; {args.episodes} episodes × {args.turns} turns × {NEW_TOKENS} new tokens; "
          f"first prompts {min(map(len, firsts))}-{max(map(len, firsts))} tokens")
    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir(), dtype=torch.float32).eval()
    flops = useful_flops(FlopModel(model.config), tokenizer, firsts, args.turns)
    peaks = Peaks(probe)
    produced = args.episodes * args.turns * NEW_TOKENS
    totals: dict[str, float] = {}

    def show(name: str, seconds: list[float], precision: str, extra: str = "") -> None:
        totals[name] = sum(seconds)
        per_turn = ", ".join(f"{s:.2f}" for s in seconds)
        print(f"{name}: {totals[name]:.2f} s (turns: {per_turn} s), {produced / totals[name]:.1f} new tokens/s; "
              f"{peaks.report(f'{name} {precision}', flops, totals[name])}{extra}", flush=True)

    # The servers first, the generate baselines (main thread) after: see measure.in_own_thread on OpenMP teams.
    # Each server side runs twice, in the order A B B A, and its faster run counts: a side's time moves by
    # ~20% from run to run on this box, and a second server in one process ran slower than the first.
    sides = (("ours", None), ("ours, prefix store off", "0"))
    runs: dict[str, list[tuple[list[float], str]]] = {name: [] for name, _ in sides}
    for name, store in (*sides, *reversed(sides)):
        runs[name].append(run_server_side(dtype, store, tokenizer, firsts, args.turns))
    for name, _ in sides:
        (seconds, counts), other = sorted(runs[name], key=lambda run: sum(run[0]))
        show(name, seconds, dtype, f"; {counts}; the other run {sum(other[0]):.2f} s")
    pad = tokenizer.pad_token_id
    for name, autocast in (("baseline: generate float32", False), ("baseline: generate bf16 autocast", True)):
        if autocast and not probe.times_bf16:
            continue
        seconds, _ = play(generate_sampler(model, pad, autocast), tokenizer, firsts, args.turns)
        show(name, seconds, "autocast" if autocast else "float32")
    faster = min((name for name in totals if name.startswith("baseline")), key=totals.get)
    print(f"ratio = ours / faster baseline ({faster}) = {totals[faster] / totals['ours']:.2f} (time ratio; no goal)")
    print(f"ratio = ours / ours with the prefix store off = {totals['ours, prefix store off'] / totals['ours']:.2f}")


if __name__ == "__main__":
    main()
