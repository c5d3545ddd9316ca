"""RL-shaped sampling through the SDK: 64 prompts × 8 samples × 16 new tokens, all requests at once.

Workload: SmolLM2-135M-Instruct behind an in-process localtinker (float32, the default), 64 distinct
arithmetic chat prompts ("What is x + y?", as in the RL recipe), ``num_samples=8``, 16 new tokens,
temperature 1, no early stop. Ours: the 64 ``sample`` futures submitted at once (what an RL loop
does), so the server prefills each prompt once and decodes all 512 rows together. Baselines, in the
same process: (a) the same 64 requests one at a time through the SDK; (b) ``model.generate(
num_return_sequences=8)`` batched over the 64 prompts, float32 and bf16 autocast (the faster counts).
Prints samples/s, achieved GFLOP/s against a matmul peak measured in the run, and the ratios
(goals: >= 4 over (a), >= 2.5 over (b)). Also, no goal: ours again with prompt 0 replaced by a
~1000-token one, as a time ratio to the uniform run (1.0 would be free; the cache stores prompts by
width class so that the short ones are not padded to the long one).

The server's prefix store (``localtinker/engine/prefix_store.py``) is off here: every side sends the same
64 prompts to the same sampler, so with it on, each side after the first would find every prompt already
computed. What keeping cold prompts costs is measured in ``bench_multiturn_sampling.py`` (its first turn)
and in the engine README (0.3-0.4% of this workload's sampling call).

Usage: ``python bench/bench_rl_sampling.py [--threads 1]``
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker
import torch
from tinker import types

from localtinker.engine.packaged import SMOLLM2_NAME, smollm2_hf_dir
from localtinker.engine.prefix_store import ENV_BUDGET
from localtinker.server import start_server
from measure import Bf16Probe, FlopModel, Peaks, server_bench_options

PROMPTS, SAMPLES, NEW_TOKENS = 64, 8, 16
LONG_PROMPT = 1000
PARAMS = types.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, stop=[])


def prompts(tokenizer, count: int) -> list[list[int]]:
    rng = random.Random(0)
    questions = [f"What is {rng.randint(0, 100)} + {rng.randint(0, 100)}?" for _ in range(count)]
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for q in questions
    ]


def long_prompt(tokenizer, length: int) -> list[int]:
    """A chat prompt of about ``length`` tokens (at least): a long sum to work out."""
    rng = random.Random(1)
    numbers: list[str] = []
    while True:
        numbers += [str(rng.randint(0, 1000)) for _ in range(10)]
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"What is {' + '.join(numbers)}?"}],
                                             add_generation_prompt=True, tokenize=False)
        tokens = tokenizer.encode(text, add_special_tokens=False)
        if len(tokens) >= length:
            return tokens


def sdk_concurrent(sampler, prompt_tokens) -> int:
    futures = [
        sampler.sample(types.ModelInput.from_ints(p), num_samples=SAMPLES, sampling_params=PARAMS.model_copy(update={"seed": i}))
        for i, p in enumerate(prompt_tokens)
    ]
    return sum(len(s.tokens) for f in futures for s in f.result().sequences)


def sdk_one_at_a_time(sampler, prompt_tokens) -> int:
    produced = 0
    for i, p in enumerate(prompt_tokens):
        params = PARAMS.model_copy(update={"seed": i})
        result = sampler.sample(types.ModelInput.from_ints(p), num_samples=SAMPLES, sampling_params=params).result()
        produced += sum(len(s.tokens) for s in result.sequences)
    return produced


def generate(model, pad: int, prompt_tokens, autocast: bool) -> int:
    width = max(len(p) for p in prompt_tokens)
    input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompt_tokens])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_tokens])
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model.generate(
            input_ids=input_ids, attention_mask=mask, do_sample=True, num_return_sequences=SAMPLES,
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=pad, top_k=0,
        )
    return (out.shape[1] - width) * out.shape[0]


def useful_flops(flop_model: FlopModel, prompt_tokens) -> float:
    """Each prompt prefilled once, any prefix several prompts share (their chat header) once
    (``FlopModel.prompts_forward``), then 8 rows × 15 decode steps."""
    prefill = flop_model.prompts_forward(prompt_tokens)
    decode = sum(
        SAMPLES * flop_model.forward(NEW_TOKENS - 1, sum(len(p) + i for i in range(1, NEW_TOKENS))) for p in prompt_tokens
    )
    return prefill + decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=PROMPTS, help="fewer for a quick check on a busy machine")
    args = server_bench_options(parser)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir())
    prompt_tokens = prompts(tokenizer, args.prompts)
    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir(), dtype=torch.float32).eval()
    flop_model = FlopModel(model.config)
    probe = Bf16Probe()
    print(probe.note())
    dtype = probe.engine_dtype(args.dtype)
    print(f"engine dtype: {dtype}")
    os.environ[ENV_BUDGET] = "0"  # the sides repeat each other's prompts: see the module docstring
    with tempfile.TemporaryDirectory() as storage, start_server(storage, dtype=dtype) as server:
        client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-bench")
        sampler = client.create_sampling_client(base_model=SMOLLM2_NAME).result()
        sdk_concurrent(sampler, prompt_tokens[:4])  # warm-up
        sides = probe.select({
            f"ours: SDK, {args.prompts} requests at once": lambda: sdk_concurrent(sampler, prompt_tokens),
            "baseline (a): SDK, one request at a time": lambda: sdk_one_at_a_time(sampler, prompt_tokens),
            "baseline (b): generate float32": lambda: generate(model, tokenizer.pad_token_id, prompt_tokens, False),
            "baseline (b): generate bf16 autocast": lambda: generate(model, tokenizer.pad_token_id, prompt_tokens, True),
        })
        peaks = Peaks(probe)
        flops = useful_flops(flop_model, prompt_tokens)
        rates = {}
        for name, run in sides.items():
            start = time.perf_counter()
            produced = run()
            seconds = time.perf_counter() - start
            rates[name] = produced / seconds
            print(f"{name}: {produced / NEW_TOKENS / seconds:.1f} samples/s, {rates[name]:.1f} new tokens/s; "
                  f"{peaks.report(name if name.startswith('baseline (b)') else f'{name} {dtype}', flops, seconds)}",
                  flush=True)
        ours_name = f"ours: SDK, {args.prompts} requests at once"
        mixed = [long_prompt(tokenizer, LONG_PROMPT)] + prompt_tokens[1:]
        start = time.perf_counter()
        produced = sdk_concurrent(sampler, mixed)
        seconds = time.perf_counter() - start
        print(f"ours with prompt 0 of {len(mixed[0])} tokens: {produced / NEW_TOKENS / seconds:.1f} samples/s, "
              f"{rates[ours_name] / (produced / seconds):.2f}x the uniform run's time (no goal; ours against ours, "
              "not a speed ratio against a baseline)", flush=True)
        client.close("success").result()
    ours = rates[ours_name]
    one_at_a_time = rates["baseline (a): SDK, one request at a time"]
    generate_best = max(rate for name, rate in rates.items() if name.startswith("baseline (b)"))
    print(f"ratio (a) = ours / one at a time = {ours / one_at_a_time:.2f} (goal >= 4)")
    print(f"ratio (b) = ours / faster generate(num_return_sequences=8) = {ours / generate_best:.2f} (goal >= 2.5)")


if __name__ == "__main__":
    main()
