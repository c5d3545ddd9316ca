"""localtinker's CUDA path against plain transformers + peft on the same GPU, side by side in one run.

Random-initialised bf16 weights of real shapes (no download): Llama-3.2-1B and Qwen3-0.6B with SmolLM2's
49152-token vocabulary (the shapes of issue #45's table), Llama-3.1-8B with its own 128256. LoRA rank 32 on
q/k/v/o/gate/up/down on both sides, AdamW. Ours: ``LocalEngine(device=DEVICE, dtype="bfloat16")`` called
directly (no HTTP). Baselines: the loop a user would write — ``model(input_ids, labels=...)`` + backward +
``torch.optim.AdamW``, and ``model.generate`` on the peft model.

Work measured (median of a few runs after a warm-up; each side on the same weights, baseline first):
- SFT step 8 × 512 (1B, 0.6B); 32 chat-like rows of 24–467 tokens (1B; the baseline pads per micro-batch of 8);
- sampling 64 prompts × 128 new tokens (the baseline's ``generate`` runs fewer new tokens, its rate is per
  token), with our share of the memory-bandwidth limit = weight bytes × decode steps / time / the card's bandwidth;
- one GRPO-shaped step, 16 prompts × 8 samples of 64 tokens + importance-sampling training step (1B), and its
  forward_backward again with each sample's prompt run whole (shared prompts off, packed_layout.py);
- the 1B SFT step and chat rows again with the training pieces as CUDA graphs (opt-in ``LOCALTINKER_TRAIN_GRAPHS``);
- the 1B sampling again with the adapter's A factors as products of their own (``LOCALTINKER_DECODE_JOINED=0``;
  by default a small model's decoder joins them to copies of the base weights), and with the opt-in decode
  attention (``LOCALTINKER_DECODE_ATTENTION=sdpa``), last;
- Llama-3.1-8B: SFT step 8 × 2048 (baseline with gradient checkpointing, as it needs to fit), MFU =
  6·N·tokens / time / the card's dense bf16 peak, peak memory; sampling 64 × 128, and 64 × 512 with its peak memory.
Prints each figure as it goes and a summary with ratios against the goals; ``--json PATH`` writes them.
Without CUDA it prints one line and exits 0.

Usage: ``python bench/bench_gpu.py [--models 1b,0.6b,8b] [--json out.json]``
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

RANK = 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES: dict[str, dict] = {
    "1b": dict(name="Llama-3.2-1B shape", model_type="llama", hidden_size=2048, intermediate_size=8192,
               num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, vocab_size=49152,
               tie_word_embeddings=True, rope_theta=500000.0),
    "0.6b": dict(name="Qwen3-0.6B shape", model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 vocab_size=49152, tie_word_embeddings=True),
    "8b": dict(name="Llama-3.1-8B shape", model_type="llama", hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
               tie_word_embeddings=False, rope_theta=500000.0),
}
# (dense bf16 FLOP/s, memory bandwidth B/s) by card, from the vendors' data sheets; the first key whose words are
# all in the card's name wins (so L40S before L4, A100 before A10)
CARDS = {"B200": (2250e12, 8.0e12), "H200": (989e12, 4.8e12), "H100 PCIe": (756e12, 2.0e12), "H100": (989e12, 3.35e12),
         "A100": (312e12, 2.0e12), "L40S": (362e12, 0.864e12), "L4": (121e12, 0.3e12), "A10": (125e12, 0.6e12)}

# --smoke: the whole flow on tiny shapes on the CPU, to check the script itself without a GPU.
SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
DEVICE = torch.device("cuda")
# Work sizes: (rows, length) of the SFT steps, prompts × new tokens of sampling, GRPO prompts × samples × tokens,
# chat rows; --smoke shrinks them all.
SIZES = dict(sft=(8, 512), sft_8b=(8, 2048), prompts=64, new=128, grpo=(16, 8, 64), chat=32)
SMOKE_SIZES = dict(sft=(2, 32), sft_8b=(2, 32), prompts=2, new=4, grpo=(2, 2, 4), chat=8)
results: dict[str, float | str] = {}
TRACE_DIR: Path | None = None  # --trace-dir


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE.type == "cuda" else 0.0


def reset_peak() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def say(key: str, value: float | str, unit: str = "") -> None:
    results[key] = value
    shown = f"{value:.4g}" if isinstance(value, float) else value
    print(f"  {key}: {shown}{unit}", flush=True)


def card_peaks() -> tuple[float | None, float | None, str]:
    name = torch.cuda.get_device_name()
    for key, peaks in CARDS.items():
        if all(part in name for part in key.split()):
            return (*peaks, name)
    return None, None, name


def timed(run: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` runs after one warm-up (0 repeats: the one run, no warm-up)."""
    if repeats == 0:
        start = time.perf_counter()
        run()
        sync()
        return time.perf_counter() - start
    run()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build_model(shape: dict) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in shape.items() if k not in ("name", "model_type")}
    config = AutoConfig.for_model(shape["model_type"], max_position_embeddings=8192, **fields)
    torch.manual_seed(0)
    with DEVICE:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every weight but the input embedding (a lookup), the head counted once."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)
    return total + (head.numel() * head.element_size() if head is embedding else 0)


# ----- the baseline: transformers + peft -------------------------------------------------------------------


def peft_wrap(model: torch.nn.Module):
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0))
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-5)
    return wrapped, optimizer


def hf_step(wrapped, optimizer, batches: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    for input_ids, mask in batches:
        labels = input_ids if mask is None else input_ids.masked_fill(mask == 0, -100)
        wrapped(input_ids=input_ids, attention_mask=mask, labels=labels).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def hf_generate(wrapped, prompts: torch.Tensor, new_tokens: int, samples: int = 1) -> torch.Tensor:
    with torch.no_grad():
        return wrapped.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_return_sequences=samples,
                                pad_token_id=0, top_k=0)


def hf_grpo_step(wrapped, optimizer, prompts: torch.Tensor, samples: int, new_tokens: int) -> None:
    sequences = hf_generate(wrapped, prompts, new_tokens, samples)
    advantages = torch.randn(sequences.shape[0], device=sequences.device)
    logits = wrapped(input_ids=sequences[:, :-1]).logits[:, prompts.shape[1] - 1 :].float()
    logprobs = logits.log_softmax(-1).gather(-1, sequences[:, prompts.shape[1] :, None]).squeeze(-1)
    ratio = torch.exp(logprobs - logprobs.detach())
    (-(ratio * advantages[:, None]).sum()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# ----- ours: the engine ------------------------------------------------------------------------------------


def datum(tokens: np.ndarray, **inputs: np.ndarray):
    from localtinker.engine.api import DatumArrays

    loss_inputs = {"target_tokens": tokens[1:], **inputs}
    loss_inputs.setdefault("weights", np.ones(len(tokens) - 1, np.float32))
    return DatumArrays(tokens=tokens[:-1], loss_fn_inputs=loss_inputs)


def our_step(engine, model_id: str, data, loss: str = "cross_entropy") -> None:
    from localtinker.engine.api import AdamSpec

    engine.forward_backward(model_id, data, loss, None, False)
    engine.optim_step(model_id, AdamSpec(learning_rate=1e-5))


def our_sample(engine, sampler_id: str, prompts: np.ndarray, new_tokens: int, samples: int = 1):
    from localtinker.engine.api import SampleSpec

    specs = [SampleSpec(prompt_tokens=tuple(int(t) for t in p), num_samples=samples, max_tokens=new_tokens, seed=i,
                        stop_token_ids=()) for i, p in enumerate(prompts)]
    results = engine.sample_batch([(sampler_id, spec) for spec in specs])
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results


def our_grpo_step(engine, model_id: str, prompts: np.ndarray, samples: int, new_tokens: int, step: list[int],
                  parts: dict[str, list[float]] | None = None) -> None:
    """One GRPO-shaped step; with ``parts``, each part's seconds (device synced) are appended under its name.
    Each part is also a named range in a profile's timeline."""
    from localtinker.engine.api import AdamSpec

    @contextlib.contextmanager
    def part(name: str):
        start = time.perf_counter()
        with torch.profiler.record_function(f"grpo.{name}"):
            yield
        if parts is not None:
            sync()
            parts.setdefault(name, []).append(time.perf_counter() - start)

    step[0] += 1
    sampler = f"grpo-{step[0]}"
    with part("snapshot"):
        engine.create_ephemeral_sampler(sampler, model_id)
    rng = np.random.default_rng(step[0])
    with part("sampling"):
        results = our_sample(engine, sampler, prompts, new_tokens, samples)
    with part("data"):
        data = []
        for prompt, result in zip(prompts, results):
            for sequence in result.sequences:
                tokens = np.concatenate([prompt, sequence.tokens])
                mask = np.zeros(len(tokens) - 1, np.float32)
                mask[len(prompt) - 1 :] = 1
                logprobs = np.zeros(len(tokens) - 1, np.float32)
                logprobs[len(prompt) - 1 :] = sequence.logprobs
                data.append(datum(tokens, logprobs=logprobs, advantages=mask * rng.standard_normal()))
    with part("forward_backward"):
        engine.forward_backward(model_id, data, "importance_sampling", None, False)
    with part("optim_step"):
        engine.optim_step(model_id, AdamSpec(learning_rate=1e-5))


def compare_training_layers(key: str, engine, name: str, model_id: str, data, repeats: int,
                            precision_shape: dict | None = None) -> None:
    """Whether the step ran the written-out (and compiled) layers (packed_layers.py), and, in the same process,
    the step through transformers' layers and the largest logprob gap between the two on the same data; with
    ``precision_shape``, each one's gap to the same model and adapter in float32 (``--precision``)."""
    from localtinker.engine.packed_layers import PackedLayers

    layers = PackedLayers.for_model(engine._hosts[name].base.model) if engine.train_layers else None
    say(f"{key}.ours.train_layers", float(layers is not None))
    if layers is None:
        return
    say(f"{key}.ours.train_layers_compiled", float(layers.compiled))
    if layers.compile_error:
        print(f"  {key}: training layers not compiled: {layers.compile_error}", flush=True)
    logprobs = lambda: np.concatenate([o["logprobs"] for o in  # noqa: E731
                                       engine.forward_backward(model_id, data[:2], "cross_entropy", None, True).loss_fn_outputs])
    ours = logprobs()
    engine.train_layers = False
    try:
        theirs = logprobs()
        say(f"{key}.layers_logprob_max_gap", float(np.abs(ours - theirs).max()))
        say(f"{key}.layers_logprob_mean_gap", float(np.abs(ours - theirs).mean()))
        if precision_shape is not None:
            exact = float32_logprobs(precision_shape, engine.lora_weights(model_id), data[:2])
            for label, values in (("layers", ours), ("transformers_layers", theirs)):
                say(f"{key}.{label}_vs_float32_mean_gap", float(np.abs(values - exact).mean()))
                say(f"{key}.{label}_vs_float32_max_gap", float(np.abs(values - exact).max()))
        say(f"{key}.ours_transformers_layers.sft_s", timed(lambda: our_step(engine, model_id, data), repeats), " s")
    finally:
        engine.train_layers = True


def compare_training_graphs(key: str, engine, name: str, sft_step: Callable[[], object],
                            chat_step: Callable[[], object] | None, repeats: int, results: dict[str, float],
                            profile: bool) -> None:
    """The SFT step (and the chat rows) again with the training pieces replayed as CUDA graphs
    (``LOCALTINKER_TRAIN_GRAPHS=1``, packed_layers.py), in this process: the opt-in path's time against the
    same baseline. A failure is printed and the pieces go back to compiled without graphs."""
    from localtinker.engine.packed_layers import PackedLayers

    layers = PackedLayers.for_model(engine._hosts[name].base.model) if engine.train_layers else None
    if layers is None or not layers.compiled:
        return
    layers.set_graphs(True)
    try:
        reset_peak()
        sft = timed(sft_step, repeats)
        say(f"{key}.ours_graphs.sft_s", sft, " s")
        say(f"{key}.ours_graphs.sft_peak_gib", peak_gib(), " GiB")
        if f"{key}.hf.sft_s" in results:
            say(f"{key}.sft_ratio_graphs", results[f"{key}.hf.sft_s"] / sft, "x")
        if chat_step is not None:
            chat = timed(chat_step, repeats)
            say(f"{key}.ours_graphs.chat_s", chat, " s")
            if f"{key}.hf.chat_s" in results:
                say(f"{key}.chat_ratio_graphs", results[f"{key}.hf.chat_s"] / chat, "x")
        say(f"{key}.ours_graphs.still_graphed", float(layers.graphs))
        if profile:
            profile_ours(sft_step, "SFT step 8 x 512, CUDA graphs")
    except Exception as error:  # noqa: BLE001 - a bench of an opt-in path: say what failed, go on
        print(f"  {key}: training graphs failed: {type(error).__name__}: {str(error).splitlines()[0]}", flush=True)
    finally:
        if layers.compile_error:
            print(f"  {key}: training graphs: {layers.compile_error}", flush=True)
        layers.compiled, layers.compile_error = True, None  # a fallback here must not slow the parts after it
        layers.set_graphs(False)


def compare_decode_variant(key: str, engine, name: str, sample: Callable[[], object], tokens: int,
                           results: dict[str, float], env: str, value: str, label: str) -> None:
    """Sampling again with ``env=value`` on fresh decoders (compiled and captured in the warm-up), in this
    process, against the same baseline: ``{key}.ours_{label}.sample_tok_s`` and ``{key}.sample_ratio_{label}``."""
    from localtinker.engine.static_decode import pooled_decoders

    pool = pooled_decoders(engine._hosts[name].base.model)
    before = os.environ.get(env)
    os.environ[env] = value
    pool.clear()
    try:
        seconds = timed(sample, 1)
        say(f"{key}.ours_{label}.sample_tok_s", tokens / seconds, " tok/s")
        if f"{key}.hf.sample_tok_s" in results:
            say(f"{key}.sample_ratio_{label}", tokens / seconds / results[f"{key}.hf.sample_tok_s"], "x")
        for error in {d.graph_error for d in pool if d.graph_error}:
            print(f"  {key}: {label}: decode graphs off: {error}", flush=True)
    except Exception as error:  # noqa: BLE001 - a comparison: say what failed, go on
        print(f"  {key}: sampling with {env}={value} failed: {type(error).__name__}: {error}", flush=True)
    finally:
        if before is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = before
        pool.clear()


def float32_logprobs(shape: dict, lora: dict[str, torch.Tensor], data) -> np.ndarray:
    """The same random weights (build_model's seed) and adapter in float32 through transformers' layers: the
    exact values both bf16 paths approximate."""
    from localtinker.engine.api import LoraSpec
    from localtinker.engine.engine import LocalEngine

    engine = LocalEngine(Path(tempfile.mkdtemp(prefix="bench-f32-")), dtype="float32", device=DEVICE, portable=True,
                         train_layers=False)
    engine.add_base_model("float32", build_model(shape).float())
    engine.create_model("float32:m", "float32", LoraSpec(rank=RANK, seed=0, train_unembed=False))
    engine._hosts["float32"].adapters.import_weights(engine._models["float32:m"].adapter, lora)
    outputs = engine.forward_backward("float32:m", data, "cross_entropy", None, True).loss_fn_outputs
    engine.unload_model("float32:m")
    engine._hosts.clear()
    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    return np.concatenate([o["logprobs"] for o in outputs])


# ----- one model ---------------------------------------------------------------------------------------------


def profile_ours(run: Callable[[], object], label: str) -> None:
    """Where one call's time goes: the top operators by device time and by host time (``--profile``); with
    ``--trace-dir``, the whole timeline as a gzipped Chrome trace there too."""
    from torch.profiler import ProfilerActivity, profile

    run()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        run()
        sync()
    events = trace.key_averages()
    print(f"  profile of ours, {label}:", flush=True)
    print(events.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=48), flush=True)
    print(events.table(sort_by="cpu_time_total", row_limit=8, max_name_column_width=48), flush=True)
    if TRACE_DIR is not None:
        TRACE_DIR.mkdir(parents=True, exist_ok=True)
        path = TRACE_DIR / (re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-") + ".json")
        trace.export_chrome_trace(str(path))
        with open(path, "rb") as raw, gzip.open(f"{path}.gz", "wb") as packed:
            shutil.copyfileobj(raw, packed)
        path.unlink()
        print(f"  trace: {path}.gz", flush=True)


def bench_model(key: str, engine, flops_peak: float | None, bandwidth: float | None, profile: bool = False,
                precision: bool = False) -> None:
    from localtinker.engine.api import LoraSpec
    from localtinker.engine.static_decode import ATTENTION_ENV, JOINED_ENV, pooled_decoders

    shape = SHAPES[key] if DEVICE.type == "cuda" else {**SHAPES[key], **SMOKE, "head_dim": 16}
    print(f"== {shape['name']} (vocab {shape['vocab_size']}, LoRA r{RANK} attn+MLP, bf16)", flush=True)
    model = build_model(shape)
    params = sum(p.numel() for p in model.parameters())
    vocab = shape["vocab_size"]
    rng = np.random.default_rng(0)
    big = key == "8b"
    sft_rows, sft_length = SIZES["sft_8b"] if big else SIZES["sft"]
    sft = rng.integers(0, vocab, size=(sft_rows, sft_length + 1))
    count, new = SIZES["prompts"], SIZES["new"]
    prompts = rng.integers(0, vocab, size=(count, 32))
    base_new = max(1, new // 8 if big else new // 4)
    grpo_prompts, grpo_samples, grpo_new = SIZES["grpo"]
    chat_rows = SIZES["chat"]
    repeats = 1 if DEVICE.type == "cpu" else (2 if big else 3)  # --smoke: each part once after its warm-up

    lengths = np.clip(np.exp(rng.normal(4.7, 0.6, size=chat_rows)), 24, 467).astype(int)  # chat-like rows
    chat = [rng.integers(0, vocab, size=n + 1) for n in lengths]

    # -- baseline (a failure is reported and ours still runs)
    wrapped, optimizer = peft_wrap(model)
    wrapped.train()  # transformers checkpoints activations only in training mode (no dropout in these configs)
    try:
        if big:
            wrapped.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        reset_peak()
        sft_gpu = torch.as_tensor(sft[:, :-1], device=DEVICE)
        hf_sft = timed(lambda: hf_step(wrapped, optimizer, [(sft_gpu, None)]), repeats)
        say(f"{key}.hf.sft_s", hf_sft, " s")
        say(f"{key}.hf.sft_peak_gib", peak_gib(), " GiB")
        if big:
            wrapped.gradient_checkpointing_disable()
        if not big:
            padded = []
            for start in range(0, chat_rows, 8):
                rows = chat[start : start + 8]
                width = max(len(r) - 1 for r in rows)
                ids = torch.zeros((len(rows), width), dtype=torch.long)
                mask = torch.zeros((len(rows), width), dtype=torch.long)
                for i, r in enumerate(rows):
                    ids[i, : len(r) - 1] = torch.as_tensor(r[:-1])
                    mask[i, : len(r) - 1] = 1
                padded.append((ids.to(DEVICE), mask.to(DEVICE)))
            real = int(lengths.sum())
            say(f"{key}.chat_tokens", float(real))
            say(f"{key}.chat_padding_share", 1 - real / (chat_rows * int(lengths.max())))
            say(f"{key}.hf.chat_s", timed(lambda: hf_step(wrapped, optimizer, padded), repeats), " s")
        prompts_gpu = torch.as_tensor(prompts, device=DEVICE)
        say(f"{key}.hf.sample_tok_s", count * base_new / timed(lambda: hf_generate(wrapped, prompts_gpu, base_new), 1),
            " tok/s")
        if key == "1b":
            first = prompts_gpu[:grpo_prompts]
            say(f"{key}.hf.grpo_s", timed(lambda: hf_grpo_step(wrapped, optimizer, first, grpo_samples, grpo_new), 3), " s")
    except Exception as error:  # noqa: BLE001
        say(f"{key}.hf.error", f"{type(error).__name__}: {error}")
    finally:
        optimizer.zero_grad(set_to_none=True)
    base = wrapped.unload().eval()
    del wrapped, optimizer
    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()

    # -- ours
    name = f"bench/{key}"
    engine.add_base_model(name, base)
    model_id = f"bench:train:{key}"
    engine.create_model(model_id, name, LoraSpec(rank=RANK, seed=0, train_unembed=False))
    reset_peak()
    sft_data = [datum(row) for row in sft]
    ours_sft = timed(lambda: our_step(engine, model_id, sft_data), repeats)
    say(f"{key}.ours.sft_s", ours_sft, " s")
    say(f"{key}.ours.sft_peak_gib", peak_gib(), " GiB")
    hf_sft = results.get(f"{key}.hf.sft_s")
    if hf_sft:
        say(f"{key}.sft_ratio", hf_sft / ours_sft, "x")
    tokens = sft_rows * sft_length
    say(f"{key}.ours.sft_tok_s", tokens / ours_sft, " tok/s")
    compare_training_layers(key, engine, name, model_id, sft_data, repeats, shape if precision else None)
    if flops_peak:
        say(f"{key}.ours.mfu_6N", 6 * params * tokens / ours_sft / flops_peak)
        if hf_sft:
            say(f"{key}.hf.mfu_6N", 6 * params * tokens / hf_sft / flops_peak)
    if not big:
        chat_data = [datum(row) for row in chat]
        ours_chat = timed(lambda: our_step(engine, model_id, chat_data), repeats)
        say(f"{key}.ours.chat_s", ours_chat, " s")
        if f"{key}.hf.chat_s" in results:
            say(f"{key}.chat_ratio", results[f"{key}.hf.chat_s"] / ours_chat, "x")
    engine.create_ephemeral_sampler(f"sampler-{key}", model_id)
    ours_sample = timed(lambda: our_sample(engine, f"sampler-{key}", prompts, new), 1)
    say(f"{key}.ours.sample_tok_s", count * new / ours_sample, " tok/s")
    if f"{key}.hf.sample_tok_s" in results:
        say(f"{key}.sample_ratio", count * new / ours_sample / results[f"{key}.hf.sample_tok_s"], "x")
    if bandwidth:
        say(f"{key}.ours.bandwidth_share", weight_bytes(base) * new / ours_sample / bandwidth)
    decoders = pooled_decoders(engine._hosts[name].base.model)
    say(f"{key}.ours.decode_graphs", float(sum(d.captured_graphs for d in decoders if d.use_graphs)))
    for error in {d.graph_error for d in decoders if d.graph_error}:
        print(f"  {key}: decode graphs off: {error}", flush=True)
    say(f"{key}.ours.decode_compiled", float(any(d.compiled for d in decoders)))
    say(f"{key}.ours.decode_joined", float(any(d.joined for d in decoders)))
    for error in {d.compile_error for d in decoders if d.compile_error}:
        print(f"  {key}: decode step not compiled: {error}", flush=True)
    if big:  # the memory check: 64 × 512 sampled on the same card that trained 8 × 2048
        reset_peak()
        long_run = timed(lambda: our_sample(engine, f"sampler-{key}", prompts, 4 * new), 0)
        say(f"{key}.ours.sample_64x{4 * new}_s", long_run, " s")
        say(f"{key}.ours.sample_64x{4 * new}_peak_gib", peak_gib(), " GiB")
    if key == "1b":
        step = [0]
        ours_grpo = timed(lambda: our_grpo_step(engine, model_id, prompts[:grpo_prompts], grpo_samples, grpo_new, step), 3)
        say(f"{key}.ours.grpo_s", ours_grpo, " s")
        if f"{key}.hf.grpo_s" in results:
            say(f"{key}.grpo_ratio", results[f"{key}.hf.grpo_s"] / ours_grpo, "x")
        parts: dict[str, list[float]] = {}  # where the step's time goes: three more steps, each part synced
        for _ in range(3):
            our_grpo_step(engine, model_id, prompts[:grpo_prompts], grpo_samples, grpo_new, step, parts)
        for part, seconds in parts.items():
            say(f"{key}.ours.grpo_{part}_s", statistics.median(seconds), " s")
        # the same steps with every sample's prompt run again (packed_layout.py's sharing off), in this process
        from localtinker.engine import packed_rows

        whole: dict[str, list[float]] = {}
        packed_rows.SHARE_PROMPTS = False
        try:
            for _ in range(3):
                our_grpo_step(engine, model_id, prompts[:grpo_prompts], grpo_samples, grpo_new, step, whole)
        finally:
            packed_rows.SHARE_PROMPTS = True
        say(f"{key}.ours.grpo_forward_backward_whole_rows_s", statistics.median(whole["forward_backward"]), " s")
    # The same training step again, now that this process has sampled (compiled decode pieces, captured graphs):
    # an RL loop trains right after sampling, and a slower step here is what it would pay.
    say(f"{key}.ours.sft_after_sampling_s", timed(lambda: our_step(engine, model_id, sft_data), repeats), " s")
    say(f"{key}.peak_gib", peak_gib(), " GiB")
    if key == "1b":
        chat_run = None if big else (lambda: our_step(engine, model_id, chat_data))
        compare_training_graphs(key, engine, name, lambda: our_step(engine, model_id, sft_data), chat_run, repeats,
                                results, profile)
    if key == "1b":
        # 1B only: decode variants on fresh decoders, the profiles, and last the opt-in decode attention
        # (sdpa's memory-efficient kernel): a capture that fails can leave the process's CUDA generator unusable
        # (docs/localtinker-gpu.md). The first sampler was superseded by the GRPO steps' snapshots since.
        engine.create_ephemeral_sampler(f"sampler-{key}-late", model_id)
        late_sample = lambda tokens=new: our_sample(engine, f"sampler-{key}-late", prompts, tokens)  # noqa: E731
        if any(d.joined for d in pooled_decoders(engine._hosts[name].base.model)):
            # the adapter's A factors as products of their own (a small model's decoder joins them by default)
            compare_decode_variant(key, engine, name, late_sample, count * new, results, JOINED_ENV, "0", "separate_a")
        if profile:
            profile_ours(lambda: our_step(engine, model_id, sft_data), "SFT step 8 x 512")
            profile_ours(lambda: late_sample(16), "sampling 64 x 16")
            profiled_steps = [100]
            profile_ours(lambda: our_grpo_step(engine, model_id, prompts[:grpo_prompts], grpo_samples, grpo_new,
                                               profiled_steps), "GRPO step")
        compare_decode_variant(key, engine, name, late_sample, count * new, results, ATTENTION_ENV, "sdpa",
                               "sdpa_attention")
    engine.unload_model(model_id)
    engine._hosts.pop(name, None)
    engine._samplers.clear()
    del base
    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


GOALS = [("1b.sft_ratio", 2.0), ("0.6b.sft_ratio", 2.0), ("1b.chat_ratio", 4.0), ("1b.sample_ratio", 20.0),
         ("0.6b.sample_ratio", 20.0), ("1b.ours.bandwidth_share", 0.25), ("8b.ours.bandwidth_share", 0.25),
         ("1b.grpo_ratio", 5.0), ("8b.ours.mfu_6N", 0.40)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="1b,0.6b,8b")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--profile", action="store_true",
                        help="also profile our 1B SFT step, a sampling call and a GRPO step")
    parser.add_argument("--precision", action="store_true",
                        help="also each training path's logprob gap to the same model in float32")
    parser.add_argument("--trace-dir", type=Path, default=None,
                        help="with --profile, also write each profiled call's timeline there (gzipped Chrome trace)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks this script, measures nothing")
    args = parser.parse_args()
    global TRACE_DIR
    TRACE_DIR = args.trace_dir
    global DEVICE
    if args.smoke:
        DEVICE = torch.device("cpu")
        SIZES.update(SMOKE_SIZES)
        # the parts a GPU takes by default and the CPU does not: the training pieces compiled (so their CUDA
        # graphs' comparison runs; here inductor's C++, no graphs) and the decoder's joined weights (so the
        # separate products' comparison runs); each can be set otherwise from the environment
        os.environ.setdefault("LOCALTINKER_TRAIN_COMPILE", "1")
        os.environ.setdefault("LOCALTINKER_DECODE_JOINED", "1")
    elif not torch.cuda.is_available():
        print(f"bench_gpu: skipped, this torch ({torch.__version__}) sees no CUDA GPU")
        return 0
    from localtinker.engine.engine import LocalEngine

    flops_peak, bandwidth, card = card_peaks() if DEVICE.type == "cuda" else (None, None, "cpu (smoke)")
    print(f"bench_gpu on {card}: peak bf16 {flops_peak and flops_peak / 1e12} TFLOP/s, bandwidth "
          f"{bandwidth and bandwidth / 1e12} TB/s (data sheet); torch {torch.__version__}", flush=True)
    results["card"] = card
    from localtinker.engine.packed_layers import LAYERS_ENV

    # the written-out training layers (packed_layers.py) unless LOCALTINKER_TRAIN_LAYERS=0, and the static decoder
    # (static_decode.py), in --smoke too
    engine = LocalEngine(Path(tempfile.mkdtemp(prefix="bench-gpu-")), dtype="bfloat16", device=DEVICE, portable=True,
                         train_layers=os.environ.get(LAYERS_ENV) != "0", static_decode=True)
    for key in args.models.split(","):
        try:
            bench_model(key, engine, flops_peak, bandwidth, args.profile, args.precision)
        except Exception as error:  # noqa: BLE001 - report what failed and go on with the next shape
            print(f"  {key}: FAILED {type(error).__name__}: {error}", flush=True)
            results[f"{key}.error"] = f"{type(error).__name__}: {error}"
            gc.collect()
            if DEVICE.type == "cuda":
                torch.cuda.empty_cache()
    print("== goals (issue #45): measured / goal", flush=True)
    for key, goal in GOALS:
        value = results.get(key)
        verdict = "n/a" if not isinstance(value, float) else ("met" if value >= goal else "not met")
        shown = f"{value:.3g}" if isinstance(value, float) else "-"
        print(f"  {key}: {shown} / {goal:g} {verdict}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
