"""The CUDA path on a real GPU (``make test-gpu``; skipped without one): every family against transformers +
peft in float32 (Qwen3-MoE with LoRA on its experts), and in bf16 the trainer against the model's own forward
and the sampler against the trainer, within the rounding of bf16 activations; weights stay bf16 on the device,
LoRA and Adam state float32."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from localtinker.engine.api import AdamSpec, LoraSpec, SampleSpec
from localtinker.engine.engine import LocalEngine
from localtinker.engine.packed_rows import takes_varlen
from tests.localtinker.engine.families import FAMILIES, SLIDING_FAMILIES, family_dir
from tests.localtinker.engine.reference import TINY, sft_datum
from tests.localtinker.engine.test_families import check_family

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# bf16 on either side: logprobs of the same tokens through different kernels and batch shapes
BF16_MEAN, BF16_MAX = 0.02, 0.15


@pytest.fixture(scope="module")
def cuda_float32(tmp_path_factory) -> LocalEngine:
    return LocalEngine(tmp_path_factory.mktemp("cuda-f32"), dtype="float32", device="cuda")


@pytest.fixture(scope="module")
def cuda_bf16(tmp_path_factory) -> LocalEngine:
    return LocalEngine(tmp_path_factory.mktemp("cuda-bf16"), dtype="bfloat16", device="cuda")


def _random_b(engine: LocalEngine, model_id: str) -> None:
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for key, param in engine._models[model_id].params.items():
            if key.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def _trainer(engine: LocalEngine, model_id: str, tokens: np.ndarray) -> np.ndarray:
    datum = sft_datum(np.random.default_rng(0), 1)
    datum.tokens = tokens[:-1]
    datum.loss_fn_inputs = {"target_tokens": tokens[1:], "weights": np.ones(len(tokens) - 1, np.float32)}
    return engine.forward_backward(model_id, [datum], "cross_entropy", None, True).loss_fn_outputs[0]["logprobs"]


def test_bf16_weights_stay_bf16_on_the_device(cuda_bf16):
    cuda_bf16.create_model("cuda:train:dtypes", TINY, LoraSpec(rank=4, seed=0))
    model = cuda_bf16._models["cuda:train:dtypes"]
    base = cuda_bf16._hosts[TINY].base.model
    assert {(p.dtype, p.device.type) for n, p in base.named_parameters() if "lora" not in n} == {(torch.bfloat16, "cuda")}
    assert {(p.dtype, p.device.type) for p in model.params.values()} == {(torch.float32, "cuda")}
    rng = np.random.default_rng(0)
    cuda_bf16.forward_backward("cuda:train:dtypes", [sft_datum(rng, 40), sft_datum(rng, 7)], "cross_entropy", None, False)
    cuda_bf16.optim_step("cuda:train:dtypes", AdamSpec(learning_rate=1e-3))
    assert {(m.dtype, m.device.type) for m in model.adam.exp_avg.values()} == {(torch.float32, "cuda")}
    assert takes_varlen(base.get_decoder(), torch.device("cuda"))  # packed rows through flash varlen


def test_bf16_trainer_matches_the_models_own_forward(cuda_bf16):
    _assert_bf16_trainer_is_the_models_own_forward(cuda_bf16, "cuda:train:hf")


def _assert_bf16_trainer_is_the_models_own_forward(engine: LocalEngine, model_id: str) -> None:
    """A new adapter (random B) on the tiny Llama: the trainer's logprobs of 300 tokens against transformers +
    peft's forward in bf16, within bf16 rounding."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from localtinker.engine.lora import LORA_ALPHA, target_module_names

    lora = LoraSpec(rank=4, seed=0)
    engine.create_model(model_id, str(family_dir("llama")), lora)
    _random_b(engine, model_id)
    reference = get_peft_model(
        AutoModelForCausalLM.from_pretrained(family_dir("llama"), dtype=torch.bfloat16).cuda(),
        LoraConfig(r=4, lora_alpha=LORA_ALPHA, target_modules=target_module_names(lora)),
    )
    named = dict(reference.named_parameters())
    with torch.no_grad():
        for key, value in engine.lora_weights(model_id).items():
            module, _, kind = key.rpartition(".")
            named[f"base_model.model.{module}.{kind}.default.weight"].copy_(value)
    tokens = np.random.default_rng(5).integers(0, 49152, size=300)
    ours = _trainer(engine, model_id, tokens)
    with torch.no_grad():
        logits = reference(input_ids=torch.as_tensor(tokens[:-1], device="cuda")[None]).logits[0].float()
    expected = logits.log_softmax(-1).gather(-1, torch.as_tensor(tokens[1:], device="cuda")[:, None]).squeeze(-1).cpu()
    errors = np.abs(ours - expected.numpy())
    assert errors.mean() < BF16_MEAN and errors.max() < BF16_MAX, (errors.mean(), errors.max())


def test_bf16_sampler_matches_the_trainer(cuda_bf16):
    cuda_bf16.create_model("cuda:train:sample", TINY, LoraSpec(rank=4, seed=1))
    _random_b(cuda_bf16, "cuda:train:sample")
    cuda_bf16.create_ephemeral_sampler("cuda-sampler", "cuda:train:sample")
    specs = [SampleSpec(prompt_tokens=tuple(range(100 + 7 * i, 120 + 9 * i)), num_samples=4, max_tokens=24, seed=i,
                        stop_token_ids=()) for i in range(4)]
    results = cuda_bf16.sample_batch([("cuda-sampler", spec) for spec in specs])
    _assert_bf16_sampler_is_the_trainer(cuda_bf16, "cuda:train:sample", specs, results)


def test_a_card_without_flash_kernels_trains_and_samples_in_bf16_through_sdpa(tmp_path, monkeypatch):
    """A card older than sm80 (a T4, a V100) has no flash kernels: packed rows and shared prompts go through sdpa
    one row at a time, prompts prefill the same way. Faked on this card by its flash rule alone (faking its compute
    capability would have Triton compile for the wrong card), with ``--dtype bfloat16`` as a user may ask: the
    trainer is the model's own forward and the sampler the trainer, as on flash."""
    from localtinker.engine import portable_attention

    monkeypatch.setattr(portable_attention, "runs_flash_kernels", lambda device: False)
    engine = LocalEngine(tmp_path, dtype="bfloat16", device="cuda")
    assert not portable_attention.varlen_available(engine.device)
    _assert_bf16_trainer_is_the_models_own_forward(engine, "cuda:noflash:hf")
    assert not takes_varlen(engine._hosts[str(family_dir("llama"))].base.model.get_decoder(), engine.device)
    engine.create_ephemeral_sampler("noflash-sampler", "cuda:noflash:hf")
    specs = [SampleSpec(prompt_tokens=tuple(range(100 + 7 * i, 120 + 9 * i)), num_samples=4, max_tokens=24, seed=i,
                        stop_token_ids=()) for i in range(3)]
    results = engine.sample_batch([("noflash-sampler", spec) for spec in specs])
    _assert_bf16_sampler_is_the_trainer(engine, "cuda:noflash:hf", specs, results)


def _assert_bf16_sampler_is_the_trainer(engine: LocalEngine, model_id: str, specs: list, results: list) -> None:
    """The sampled tokens' logprobs against the trainer's on the same tokens, within bf16 rounding."""
    errors = []
    for spec, result in zip(specs, results):
        assert not isinstance(result, Exception), result
        for sequence in result.sequences:
            full = np.array(spec.prompt_tokens + tuple(sequence.tokens))
            trainer = _trainer(engine, model_id, full)[len(spec.prompt_tokens) - 1 :]
            errors.append(np.abs(np.array(sequence.logprobs) - trainer))
    errors = np.concatenate(errors)
    assert errors.mean() < BF16_MEAN and errors.max() < BF16_MAX, (errors.mean(), errors.max())


def test_decode_graphs_agree_with_the_trainer(tmp_path):
    """The static decode step replayed as CUDA graphs (the GPU's default sampler: prompts prefilled through its
    pieces, layer pieces compiled where Triton is, cache writes and tokens chosen inside the graph, the adapter's
    A joined to the base weights, one step queued ahead), in float32, across row compaction and cache growth, and
    again from the pooled decoder: its logprobs are the trainer's on the tokens it drew.
    (Tokens are not compared between runs: a tiny random model's near-uniform distribution turns float32
    kernel noise, such as a bucket's graph recaptured with other compiled kernels, into a different draw.)"""
    decoder = check_decode_graphs(tmp_path)
    assert decoder.joined  # a small model: the adapter's A rows joined to the decoder's copy of the base weights
    assert not decoder.sdpa_attention


def check_decode_graphs(tmp_path):
    """Samples through CUDA graphs, twice, and checks the logprobs against the trainer's; returns the decoder."""
    from localtinker.engine.static_decode import MIN_COLUMNS, pooled_decoders

    lengths = (4, 40, MIN_COLUMNS + 10)  # rows leave at different steps; the last grows the cache
    specs = [SampleSpec(prompt_tokens=tuple(range(100 + 7 * i, 120 + 9 * i)), num_samples=3, max_tokens=n, seed=i,
                        stop_token_ids=()) for i, n in enumerate(lengths)]
    engine = LocalEngine(tmp_path, dtype="float32", device="cuda")
    engine.create_model("cuda:train:graphs", TINY, LoraSpec(rank=4, seed=1))
    _random_b(engine, "cuda:train:graphs")
    engine.create_ephemeral_sampler("graphs", "cuda:train:graphs")
    results = engine.sample_batch([("graphs", spec) for spec in specs])
    (decoder,) = pooled_decoders(engine._hosts[TINY].base.model)
    assert decoder.use_graphs and decoder.captured_graphs >= 1, decoder.graph_error
    assert decoder.compiled == (importlib.util.find_spec("triton") is not None), decoder.compile_error
    assert decoder.columns == 2 * MIN_COLUMNS  # graphs captured again after the cache grew
    again = engine.sample_batch([("graphs", spec) for spec in specs])  # the pooled decoder, its graphs kept
    for spec, result in zip(specs + specs, results + again):
        assert not isinstance(result, Exception), result
        for sequence in result.sequences:
            assert len(sequence.tokens) == spec.max_tokens
            full = np.array(spec.prompt_tokens + tuple(sequence.tokens))
            trainer = _trainer(engine, "cuda:train:graphs", full)[len(spec.prompt_tokens) - 1 :]
            np.testing.assert_allclose(sequence.logprobs, trainer, atol=1e-4, rtol=0)
    return decoder


def test_the_real_sdk_through_a_server_whose_engine_runs_on_the_gpu_from_its_worker_thread(tmp_path):
    """What a user runs: the tinker SDK over HTTP to ``localtinker serve --device cuda``. The engine computes on
    the protocol's worker thread, not the caller's (the other tests call it directly): its pieces compile, its
    decode graphs are captured and its card is current there. Training lowers the loss; eight requests sampled at
    once through the graphs give the logprobs the sampler then scores the same tokens with."""
    import tinker
    from tinker import types

    from localtinker.engine.static_decode import pooled_decoders
    from localtinker.server import start_server

    engine = LocalEngine(tmp_path / "storage", dtype="bfloat16", device="cuda")
    with start_server(tmp_path / "storage", engine=engine) as server:
        client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-local")
        trainer = client.create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
        tokens = [int(t) for t in np.random.default_rng(3).integers(0, 1000, size=41)]
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        losses = []
        for _ in range(4):
            losses.append(trainer.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
            trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert losses[-1] < losses[0], losses
        sampler = trainer.save_weights_and_get_sampling_client("gpu-server").result()
        prompts = [tokens[i : i + 6 + i] for i in range(8)]
        futures = [sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2,
                                  sampling_params=types.SamplingParams(max_tokens=12, seed=i, stop=[]))
                   for i, prompt in enumerate(prompts)]
        errors = []
        for prompt, future in zip(prompts, futures):
            for sequence in future.result().sequences:
                assert len(sequence.tokens) == 12
                scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + sequence.tokens)).result()
                errors.append(np.abs(np.array(scored[len(prompt):]) - np.array(sequence.logprobs)))
        errors = np.concatenate(errors)
        assert errors.mean() < BF16_MEAN and errors.max() < BF16_MAX, (errors.mean(), errors.max())
        (decoder,) = pooled_decoders(engine._hosts[TINY].base.model)
        assert decoder.use_graphs and decoder.captured_graphs >= 1, decoder.graph_error
        client.close("success").result(timeout=60)


def test_running_out_of_gpu_memory_is_a_user_error_and_the_next_step_runs(tmp_path):
    """A real CUDA out-of-memory (the process capped a little above what it holds, the micro-batches still sized
    by the card's free memory): the request fails as a DeviceMemoryError naming its size and the free memory,
    the gradients accumulated before stay, and with the cap lifted the same engine trains on."""
    from localtinker.engine.memory_errors import DeviceMemoryError

    engine = LocalEngine(tmp_path, dtype="bfloat16", device="cuda")
    model_id = "cuda:train:oom"
    engine.create_model(model_id, TINY, LoraSpec(rank=4, seed=0))
    rng = np.random.default_rng(0)
    small = [sft_datum(rng, 16)]
    engine.forward_backward(model_id, small, "cross_entropy", None, False)
    grads = engine.lora_grads(model_id)  # copies
    big = [sft_datum(rng, 1024) for _ in range(128)]  # 128k tokens: each 2048-token logits chunk is 400 MB
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.synchronize()
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (64 << 20)) / total)
    try:
        with pytest.raises(DeviceMemoryError, match=r"forward_backward of 128 datums \(\d+ tokens\) ran out of cuda"
                                                    r".* GiB free of .*; nothing was changed"):
            engine.forward_backward(model_id, big, "cross_entropy", None, False)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    after = engine.lora_grads(model_id)
    assert all(after[key] is None if grad is None else torch.equal(after[key], grad) for key, grad in grads.items())
    engine.forward_backward(model_id, small, "cross_entropy", None, False)
    engine.optim_step(model_id, AdamSpec(learning_rate=1e-3))


def test_the_cards_room_for_a_model_counts_torchs_unused_cache():
    """model_memory.available_bytes on the card: a freed GiB that torch's cache keeps is still room for a model."""
    from localtinker.engine.model_memory import available_bytes

    device = torch.device("cuda", torch.cuda.current_device())
    before, where = available_bytes(device)
    block = torch.empty(2**30, dtype=torch.uint8, device=device)
    held = available_bytes(device)[0]
    del block
    after = available_bytes(device)[0]
    assert where.startswith(f"free on {device}") and 0 < before <= torch.cuda.mem_get_info(device)[1]
    assert abs(before - held - 2**30) < 2**26 and abs(after - before) < 2**26, (before, held, after)


def test_adapter_tensors_cross_to_pinned_host_memory_and_back_in_one_copy():
    """host_transfer on a GPU: a snapshot of many CUDA tensors is views of one pinned buffer per dtype, equal to
    them; copied back into CUDA tensors it lands exactly, from that buffer and from separate host tensors."""
    from localtinker.engine.host_transfer import copy_into, to_host

    generator = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.lora_{ab}": torch.randn(32, 64 + i, generator=generator).cuda()
               for i in range(8) for ab in "AB"}
    tensors["count"] = torch.arange(5, device="cuda")
    copies = to_host(tensors)
    assert all(copy.device.type == "cpu" and copy.is_pinned() for copy in copies.values())
    assert len({copies[key].untyped_storage().data_ptr() for key in tensors if key != "count"}) == 1
    for sources in (copies, {key: value.clone() for key, value in copies.items()}):
        targets = {key: torch.zeros_like(value) for key, value in tensors.items()}
        copy_into(targets, sources)
        torch.cuda.synchronize()
        assert all(torch.equal(targets[key], tensors[key]) for key in tensors)


def test_a_checkpoint_round_trip_on_the_gpu_keeps_the_optimizer_state_there(tmp_path):
    """save_state then load_state / load_state_into with the optimizer: the adapter and both moments come back
    equal and on the device (load_state_into left them on the host, where the next optim_step failed)."""
    engine = LocalEngine(tmp_path, dtype="bfloat16", device="cuda")
    engine.create_model("cuda:train:ckpt", TINY, LoraSpec(rank=4, seed=0))
    rng = np.random.default_rng(0)
    for _ in range(2):
        engine.forward_backward("cuda:train:ckpt", [sft_datum(rng, 16)], "cross_entropy", None, False)
        engine.optim_step("cuda:train:ckpt", AdamSpec(learning_rate=1e-3))
    saved = engine._models["cuda:train:ckpt"]
    path = engine.save_state("cuda:train:ckpt", "two-steps")
    engine.load_state("cuda:train:restored", path, True, None)
    engine.create_model("cuda:train:into", TINY, LoraSpec(rank=4, seed=1))
    engine.load_state_into("cuda:train:into", path, True)
    for model_id in ("cuda:train:restored", "cuda:train:into"):
        model = engine._models[model_id]
        assert all(torch.equal(model.params[key], saved.params[key]) for key in saved.params)
        for kind in ("exp_avg", "exp_avg_sq"):
            moments, expected = getattr(model.adam, kind), getattr(saved.adam, kind)
            assert all(value.device.type == "cuda" and torch.equal(value, expected[key]) for key, value in moments.items())
        engine.forward_backward(model_id, [sft_datum(rng, 16)], "cross_entropy", None, False)
        engine.optim_step(model_id, AdamSpec(learning_rate=1e-3))


def test_the_log_softmax_compiled_on_the_gpu_equals_the_plain_formula():
    """chunked_logprobs.py compiles its two functions on CUDA with Triton (one pass each over bf16 logits, no
    float32 [tokens × vocab] tensor): bf16 logprobs and gradients over SmolLM2's vocabulary equal autograd
    through the float32 formula on the same logits, with and without a soft cap and a temperature. One chunk:
    the same product on both sides, so the logits are the same (chunking is checked on the CPU)."""
    from localtinker.engine import chunked_logprobs
    from tests.localtinker.engine.test_chunked_logprobs import compare_with_plain

    device = torch.device("cuda", torch.cuda.current_device())
    for softcap, temperature in ((None, 1.0), (30.0, 0.8)):
        compare_with_plain(softcap, temperature, chunks=(4096,), dtype=torch.bfloat16, device=device, vocab=49152,
                           atol=1e-4, grad_tolerance=2e-2)
    assert chunked_logprobs._compile_on[device] == (importlib.util.find_spec("triton") is not None)


def test_shared_prompts_through_flash_varlen_equal_whole_rows():
    """The flash varlen kernel with query segments shorter than their keys (packed_layout.py): a member's own
    tokens see their whole prompt and their own past, as attending each datum whole does (causal aligned at the
    keys' end; a kernel aligned at the start would let them see only the prompt's first rows)."""
    from tests.localtinker.engine.test_packed_layout import segment_attention_by_datum

    for system in (0, 24):  # groups alone; groups behind a system prompt laid once (three key ranges)
        for window in (None, 7):  # and the kernel's sliding window, against the CPU's masked sdpa in float32
            shared, whole = segment_attention_by_datum(torch.device("cuda"), torch.bfloat16, system, window)
            _, reference = segment_attention_by_datum(torch.device("cpu"), torch.float32, system, window)
            for index, expected in reference.items():  # bf16 inputs: ~0.015 off float32 on the CPU's sdpa
                torch.testing.assert_close(whole[index], expected, atol=3e-2, rtol=0)
                torch.testing.assert_close(shared[index], expected, atol=3e-2, rtol=0)


def test_attention_sinks_through_flash_and_soft_caps_equal_the_explicit_softmax():
    """gpt-oss's sinks over the flash kernel and Gemma 2's soft cap on the explicit kernels (beyond_flash.py): the
    bf16 output and the gradients of q, k, v (and the sinks) — the kernel's backward fed the corrected dO and out —
    equal the explicit float32 formula on the CPU, with shared prompts and a window, within bf16 rounding of each
    tensor's scale; and the kernel was not given up for the explicit one."""
    from localtinker.engine import beyond_flash
    from localtinker.engine.packed_layout import PackedLayout
    from localtinker.engine.portable_attention import packed_causal_attention
    from tests.localtinker.engine.test_beyond_flash import inputs, reference, shared_layout, values_and_gradients

    cuda, cpu = torch.device("cuda", torch.cuda.current_device()), torch.device("cpu")
    for softcap, sinks in ((None, True), (2.0, False)):
        for shared in (False, True):
            for window in (None, 4):
                layouts = [shared_layout(d) if shared else PackedLayout.rows([7, 4, 6], d) for d in (cuda, cpu)]
                ours = values_and_gradients(packed_causal_attention, inputs(cuda, torch.bfloat16, dim=64), layouts[0],
                                            window, softcap, sinks)
                expected = values_and_gradients(reference, inputs(cpu, torch.float32, dim=64), layouts[1], window,
                                                softcap, sinks)
                for name, mine, theirs in zip(("out", "dq", "dk", "dv", "dsinks"), ours, expected):
                    scale = max(1.0, float(theirs.abs().max()))
                    torch.testing.assert_close(mine.cpu(), theirs, atol=3e-2 * scale, rtol=0,
                                               msg=f"{name} {window} {softcap}")
    assert beyond_flash._flash_error is None


def test_grpo_batches_share_prompts_on_the_gpu(cuda_bf16, monkeypatch):
    """A GRPO-shaped batch in bf16 (written-out layers, flash varlen): the shared prompts' logprobs and
    gradients are those of whole rows, within bf16 rounding."""
    from localtinker.engine import packed_rows

    cuda_bf16.create_model("cuda:train:share", TINY, LoraSpec(rank=4, seed=3))
    _random_b(cuda_bf16, "cuda:train:share")
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 49152, size=n) for n in (24, 40)]
    data = []
    for prompt in prompts:
        for _ in range(4):
            tokens = np.concatenate([prompt, rng.integers(0, 49152, size=int(rng.integers(3, 30)))])
            data.append(sft_datum(rng, 1))
            data[-1].tokens = tokens[:-1]
            data[-1].loss_fn_inputs = {"target_tokens": tokens[1:], "weights": np.ones(len(tokens) - 1, np.float32)}
    runs = {}
    for share in (False, True):
        monkeypatch.setattr(packed_rows, "SHARE_PROMPTS", share)
        result = cuda_bf16.forward_backward("cuda:train:share", data, "cross_entropy", None, False)
        runs[share] = [o["logprobs"] for o in result.loss_fn_outputs], cuda_bf16.lora_grads("cuda:train:share")
        cuda_bf16.optim_step("cuda:train:share", AdamSpec(learning_rate=0.0))
    errors = np.concatenate([np.abs(a - b) for a, b in zip(runs[True][0], runs[False][0])])
    assert errors.mean() < BF16_MEAN and errors.max() < BF16_MAX, (errors.mean(), errors.max())
    for key, expected in runs[False][1].items():
        scale = float(expected.abs().max())
        assert float((runs[True][1][key] - expected).abs().max()) <= 0.05 * scale + 1e-6, key


def test_training_pieces_replayed_as_cuda_graphs_train_as_without(tmp_path, monkeypatch):
    """``LOCALTINKER_TRAIN_GRAPHS=1`` (packed_layers.py): over several micro-batches of different buckets, two
    forward_backward calls (gradients accumulate) and an optimizer step (the factors move in place: the graphs
    must read them where they are), the logprobs and gradients are those of the compiled pieces without graphs,
    and no piece skipped its graphs."""
    from localtinker.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "device_microbatch_tokens", lambda *args: 1024)
    check_graphed_training(LocalEngine(tmp_path, dtype="float32", device="cuda"))


def check_graphed_training(engine: LocalEngine, replayed: bool = True) -> None:
    """The check above on ``engine``; ``replayed=False`` where the compiler skips the graphs (a CPU)."""
    from torch._dynamo.utils import counters

    from localtinker.engine.packed_layers import PackedLayers

    rng = np.random.default_rng(8)
    data = [sft_datum(rng, n) for n in (300, 500, 90, 700, 260, 410)]
    runs = {}
    for graphs in (False, True):
        model_id = f"cuda:train:graphs:{graphs}"
        engine.create_model(model_id, TINY, LoraSpec(rank=4, seed=2))
        _random_b(engine, model_id)  # the same adapter for both
        layers = PackedLayers.for_model(engine._hosts[TINY].base.model)
        assert layers is not None and layers.compiled, layers and layers.compile_error
        layers.set_graphs(graphs)
        counters.clear()
        engine.forward_backward(model_id, data, "cross_entropy", None, False)
        engine.forward_backward(model_id, data[::-1], "cross_entropy", None, False)
        grads = engine.lora_grads(model_id)
        engine.optim_step(model_id, AdamSpec(learning_rate=1e-2))
        result = engine.forward_backward(model_id, data, "cross_entropy", None, False)
        scored = engine.forward_backward(model_id, data[:3], "cross_entropy", None, True)  # inference mode
        for trained, forward_only in zip(result.loss_fn_outputs, scored.loss_fn_outputs):
            np.testing.assert_allclose(forward_only["logprobs"], trained["logprobs"], atol=1e-5)
        runs[graphs] = [o["logprobs"] for o in result.loss_fn_outputs], grads, engine.lora_grads(model_id)
        assert layers.compiled and layers.graphs == graphs
        assert (counters["inductor"]["cudagraph_skips"] == 0) == (replayed or not graphs)
    for without, with_graphs in zip(runs[False][0], runs[True][0]):
        np.testing.assert_allclose(with_graphs, without, atol=1e-4)
    for grads_without, grads_with in zip(runs[False][1:], runs[True][1:]):
        assert grads_with.keys() == grads_without.keys()
        for key, expected in grads_without.items():
            if expected is None:
                assert grads_with[key] is None, key
                continue
            assert float((grads_with[key] - expected).abs().max()) <= 1e-4 * float(expected.abs().max()) + 1e-7, key


def test_moe_expert_lora_as_grouped_gemms_on_the_gpu(monkeypatch):
    """bf16 experts on the GPU with a rank-4 LoRA (padded to 16-byte rows: grouped GEMMs) give what the
    expert-by-expert loop gives, forward and backward, and no grouped kernel fell back."""
    import warnings

    from localtinker.engine import expert_lora
    from tests.localtinker.engine.test_expert_lora import _experts, _randomize, _routing

    module = _experts(torch.bfloat16).cuda()
    adapters = expert_lora.adapters_of(module)
    adapters.add("a", rank=4, scaling=4.0)
    _randomize(adapters.factors["a"], 1)
    adapters.activate("a")
    hidden, index, weights = (t.cuda() for t in _routing(256))

    def run() -> list[torch.Tensor]:
        x = hidden.bfloat16().requires_grad_(True)
        out = module(x, index, weights)
        out.float().square().sum().backward()
        grads = [out.float(), x.grad.float(), *(factor.grad.clone() for factor in adapters.factors["a"].values())]
        for factor in adapters.factors["a"].values():
            factor.grad = None
        return grads

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a grouped kernel that falls back warns
        grouped = run()
    assert "cuda" not in expert_lora._grouped_failed
    monkeypatch.setattr(expert_lora, "GROUPED", False)
    for ours, theirs in zip(grouped, run()):
        assert (ours - theirs).norm() <= 0.05 * theirs.norm() + 1e-6  # bf16 through other kernels: ~1% on the CPU


def test_moe_decode_graphs_in_bf16_agree_with_the_trainer(tmp_path, monkeypatch):
    """Qwen3-MoE in bf16 with LoRA on its experts (rank 2 each, padded for the grouped GEMMs): each step's MoE
    blocks run inside the CUDA graph, and the sampler's logprobs are the trainer's within bf16 rounding. The
    pieces and the log-softmax run uncompiled (their compiled forms are the other tests'): nothing compiles here."""
    from localtinker.engine.decode_layer import COMPILE_ENV, TRAIN_COMPILE_ENV
    from localtinker.engine.static_decode import pooled_decoders

    monkeypatch.setenv(COMPILE_ENV, "0")
    monkeypatch.setenv(TRAIN_COMPILE_ENV, "0")

    engine = LocalEngine(tmp_path, dtype="bfloat16", device="cuda")
    base = str(family_dir("qwen3_moe"))
    engine.create_model("cuda:train:moe", base, LoraSpec(rank=4, seed=1))
    _random_b(engine, "cuda:train:moe")
    engine.create_ephemeral_sampler("moe", "cuda:train:moe")
    specs = [SampleSpec(prompt_tokens=tuple(range(200 + i, 230 + 3 * i)), num_samples=2, max_tokens=24, seed=i,
                        stop_token_ids=()) for i in range(3)]
    results = engine.sample_batch([("moe", spec) for spec in specs])
    (decoder,) = pooled_decoders(engine._hosts[base].base.model)
    assert decoder.use_graphs and decoder.captured_graphs >= 1, decoder.graph_error
    _assert_bf16_sampler_is_the_trainer(engine, "cuda:train:moe", specs, results)


# Near the end: the families, each compiling its own pieces, are most of this file's time (scripts/gpu_check.sh
# runs them in a process of their own, after the rest, within its limit).
@pytest.mark.parametrize("family", FAMILIES + SLIDING_FAMILIES)
def test_families_in_float32_on_the_gpu(cuda_float32, family, tmp_path):
    check_family(cuda_float32, family, 1e-4, tmp_path)


def test_decode_graphs_with_sdpa_attention_agree_with_the_trainer(tmp_path, monkeypatch):
    """The opt-in decode attention (``LOCALTINKER_DECODE_ATTENTION=sdpa``: sdpa's memory-efficient kernel, the
    hidden columns as a bias) captured in the graphs, as the default's check. Last in this file: a capture that
    fails can leave the process's CUDA generator unusable (docs/localtinker-gpu.md)."""
    monkeypatch.setenv("LOCALTINKER_DECODE_ATTENTION", "sdpa")
    assert check_decode_graphs(tmp_path).sdpa_attention
