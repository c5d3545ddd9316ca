"""The portable path (what a CUDA device runs), exercised on the CPU: packed rows and chunked logprobs equal
the tuned CPU path, and the KV-cache sampler batches continuously (requests join mid-decode, rows leave),
honours greedy, top-k, stop ids and prompt logprobs, and agrees with the trainer (float32 ≤ 1e-5; bf16 within
the rounding of bf16 activations)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localtinker.engine import chunked_logprobs, engine as engine_module, portable_sampling
from localtinker.engine.api import LoraSpec, SampleSpec
from localtinker.engine.engine import LocalEngine
from tests.localtinker.engine.families import family_dir
from tests.localtinker.engine.reference import TINY, sft_datum

LORA = LoraSpec(rank=4, seed=5)


@pytest.fixture(scope="module")
def portable(tmp_path_factory) -> LocalEngine:
    return LocalEngine(tmp_path_factory.mktemp("portable"), dtype="float32", portable=True)


def _randomise_b(engine: LocalEngine, model_id: str) -> None:
    generator = torch.Generator().manual_seed(1)
    model = engine._models[model_id]
    with torch.no_grad():
        for key, param in model.params.items():
            if key.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def test_packed_rows_equal_the_tuned_path(portable, engine, new_id, monkeypatch):
    monkeypatch.setattr(engine_module, "TRAIN_MICROBATCH_TOKENS", 24)  # several packed micro-batches
    monkeypatch.setattr(chunked_logprobs, "LOGIT_CHUNK_TOKENS", 7)  # several logit chunks per micro-batch
    rng = np.random.default_rng(4)
    data = [sft_datum(rng, n) for n in (3, 17, 9, 30, 5)]
    results = {}
    for name, eng in (("portable", portable), ("tuned", engine)):
        model_id = new_id()
        eng.create_model(model_id, TINY, LORA)
        _randomise_b(eng, model_id)
        results[name] = (eng.forward_backward(model_id, data, "cross_entropy", None, False), eng.lora_grads(model_id))
    (ours, our_grads), (tuned, tuned_grads) = results["portable"], results["tuned"]
    for a, b in zip(ours.loss_fn_outputs, tuned.loss_fn_outputs):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-5, rtol=0)
    assert ours.metrics["loss:sum"] == pytest.approx(tuned.metrics["loss:sum"], rel=1e-6)
    for key, grad in our_grads.items():
        torch.testing.assert_close(grad, tuned_grads[key], atol=1e-5, rtol=1e-4, msg=key)


def _trainer_logprobs(engine: LocalEngine, model_id: str, prompt: tuple[int, ...], tokens: list[int]) -> np.ndarray:
    full = np.array(prompt + tuple(tokens))
    datum = sft_datum(np.random.default_rng(0), 1)
    datum.tokens = full[:-1]
    datum.loss_fn_inputs = {"target_tokens": full[1:], "weights": np.ones(len(full) - 1, np.float32)}
    return engine.forward_backward(model_id, [datum], "cross_entropy", None, True).loss_fn_outputs[0]["logprobs"][len(prompt) - 1 :]


def test_requests_join_mid_decode_and_agree_with_the_trainer(portable, new_id):
    model_id = new_id()
    portable.create_model(model_id, TINY, LORA)
    _randomise_b(portable, model_id)
    portable.create_ephemeral_sampler("portable-join", model_id)
    stream = portable.sample_stream()
    first = SampleSpec(prompt_tokens=tuple(range(100, 112)), num_samples=3, max_tokens=10, seed=1, stop_token_ids=())
    late = SampleSpec(prompt_tokens=tuple(range(300, 304)), num_samples=2, max_tokens=4, seed=2, stop_token_ids=())
    stream.submit("first", "portable-join", first)
    done = {}
    for step in range(30):
        if step == 3:
            stream.submit("late", "portable-join", late)
        done.update(dict(stream.step()))
        if not stream.busy:
            break
    assert set(done) == {"first", "late"} and not stream.busy
    for key, spec in (("first", first), ("late", late)):
        assert [len(s.tokens) for s in done[key].sequences] == [spec.max_tokens] * spec.num_samples
        for sequence in done[key].sequences:
            expected = _trainer_logprobs(portable, model_id, spec.prompt_tokens, sequence.tokens)
            np.testing.assert_allclose(sequence.logprobs, expected, atol=1e-5, rtol=0)


def test_greedy_top_k_and_stop_ids(portable, new_id):
    model_id = new_id()
    portable.create_model(model_id, TINY, LORA)
    portable.create_ephemeral_sampler("portable-choice", model_id)
    prompt = tuple(range(50, 60))
    greedy, top1 = portable.sample_batch([
        ("portable-choice", SampleSpec(prompt_tokens=prompt, max_tokens=5, temperature=0.0, stop_token_ids=())),
        ("portable-choice", SampleSpec(prompt_tokens=prompt, max_tokens=5, top_k=1, seed=3, stop_token_ids=())),
    ])
    assert greedy.sequences[0].tokens == top1.sequences[0].tokens
    stop_at = greedy.sequences[0].tokens[2]
    stopped = portable.sample_batch([("portable-choice", SampleSpec(
        prompt_tokens=prompt, max_tokens=5, temperature=0.0, stop_token_ids=(stop_at,), prompt_logprobs=True))])[0]
    assert stopped.sequences[0].stop_reason == "stop" and stopped.sequences[0].tokens[-1] == stop_at
    assert stopped.prompt_logprobs[0] is None and len(stopped.prompt_logprobs) == len(prompt)
    zero = portable.sample_batch([("portable-choice", SampleSpec(prompt_tokens=prompt, max_tokens=0))])[0]
    assert zero.sequences[0].tokens == []


def test_bf16_sampler_agrees_with_the_trainer(tmp_path, new_id):
    """bf16 weights on the portable path (as on a GPU): sampler and trainer differ only by bf16 rounding of
    activations computed in different batch shapes (decode steps against a packed row)."""
    engine = LocalEngine(tmp_path, dtype="bfloat16", portable=True)
    model_id = new_id()
    engine.create_model(model_id, TINY, LORA)
    assert all(p.dtype == torch.float32 for p in engine._models[model_id].params.values())
    base_weights = [p for n, p in engine._hosts[TINY].base.model.named_parameters() if "lora" not in n]
    assert {p.dtype for p in base_weights} == {torch.bfloat16}  # no float32 copy of a base weight
    engine.create_ephemeral_sampler("portable-bf16", model_id)
    spec = SampleSpec(prompt_tokens=tuple(range(10, 30)), num_samples=4, max_tokens=8, seed=4, stop_token_ids=())
    result = engine.sample_batch([("portable-bf16", spec)])[0]
    errors = np.concatenate([
        np.abs(np.array(s.logprobs) - _trainer_logprobs(engine, model_id, spec.prompt_tokens, s.tokens))
        for s in result.sequences
    ])
    assert errors.mean() < 0.02 and errors.max() < 0.1, (errors.mean(), errors.max())


@pytest.mark.parametrize("loss, config", [("importance_sampling", None), ("ppo", None), ("cispo", None),
                                          ("dro", {"beta": 0.1}), ("gspo", None)])
def test_every_loss_equals_the_tuned_path(portable, engine, new_id, loss, config):
    """The RL losses on the portable path's device tensors: the tuned path's losses, logprobs and gradients."""
    from localtinker.engine.api import DatumArrays

    rng = np.random.default_rng(6)
    data = []
    for length in (12, 25):
        tokens = rng.integers(0, 49152, size=length + 1)
        mask = (np.arange(length) >= 4).astype(np.float32)
        data.append(DatumArrays(tokens=tokens[:-1], loss_fn_inputs={
            "target_tokens": tokens[1:], "logprobs": (-11.0 + rng.random(length)).astype(np.float32) * mask,
            "advantages": (rng.standard_normal(length) * mask).astype(np.float32), "sequence_ratio_mask": mask,
        }))
    outcomes = []
    for eng in (portable, engine):
        model_id = new_id()
        eng.create_model(model_id, TINY, LORA)
        _randomise_b(eng, model_id)
        outcomes.append((eng.forward_backward(model_id, data, loss, config, False), eng.lora_grads(model_id)))
    (ours, our_grads), (tuned, tuned_grads) = outcomes
    assert ours.metrics["loss:sum"] == pytest.approx(tuned.metrics["loss:sum"], rel=1e-5, abs=1e-6)
    for a, b in zip(ours.loss_fn_outputs, tuned.loss_fn_outputs):
        np.testing.assert_allclose(a["elementwise_loss"], b["elementwise_loss"], atol=1e-5, rtol=1e-5)
    for key, grad in our_grads.items():
        torch.testing.assert_close(grad, tuned_grads[key], atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.parametrize("static", [True, False], ids=["static-decoder", "dynamic-cache"])
def test_a_burst_larger_than_the_devices_memory_runs_in_turns(tmp_path, new_id, monkeypatch, static):
    """Six requests whose caches together need more than the device has free (faked: the room for any two at
    once) are admitted two at a time as earlier ones finish, rather than all at once into an out-of-memory error;
    each gets all its tokens, with the trainer's logprobs. Nothing running, a request larger than the room still
    starts (alone)."""
    engine = LocalEngine(tmp_path, dtype="float32", portable=True, static_decode=static)
    model_id = new_id()
    engine.create_model(model_id, TINY, LORA)
    _randomise_b(engine, model_id)
    engine.create_ephemeral_sampler("burst", model_id)
    specs = [SampleSpec(prompt_tokens=tuple(range(100 + 9 * i, 110 + 9 * i)), num_samples=3, max_tokens=6, seed=i,
                        stop_token_ids=()) for i in range(6)]
    stream = engine.sample_stream().portable
    for index, spec in enumerate(specs):
        stream.submit(index, "burst", spec)
    two = portable_sampling.projected_cache_bytes(list(stream._pending)[:2], {stream._pending[0].weights:
                                                                                engine.cache_bytes_per_token("burst")})
    room = two / portable_sampling.CACHE_MEMORY_SHARE + 16  # (a little over: the share is rounded down)
    monkeypatch.setattr(portable_sampling, "available_bytes",
                        lambda device: (int(room) - sum(b.cache_bytes for b in stream._batches.values()), "faked"))
    done, most = {}, 0
    while stream.busy:
        done.update(dict(stream.step()))
        most = max(most, len(stream._admitted))
    assert most == 2 and sorted(done) == list(range(6))
    for index, spec in enumerate(specs):
        assert not isinstance(done[index], Exception), done[index]
        for sequence in done[index].sequences:
            assert len(sequence.tokens) == spec.max_tokens
            expected = _trainer_logprobs(engine, model_id, spec.prompt_tokens, sequence.tokens)
            np.testing.assert_allclose(sequence.logprobs, expected, atol=1e-5, rtol=0)
    monkeypatch.setattr(portable_sampling, "available_bytes", lambda device: (0, "faked"))
    stream.submit("alone", "burst", specs[0])
    while stream.busy:
        done.update(dict(stream.step()))
    assert [len(s.tokens) for s in done["alone"].sequences] == [spec.max_tokens] * 3


def test_the_cache_bytes_per_token_are_what_the_static_decoders_cache_holds():
    """projected_cache_bytes' unit: slots × columns × cache_bytes_per_token is the static decoder's cache, for
    families of different head shapes (GQA, Qwen3's head dim, Gemma's)."""
    from transformers import AutoModelForCausalLM

    from localtinker.engine.static_decode import StaticDecoder
    from tests.localtinker.engine.families import family_dir

    for family in ("llama", "qwen3", "gemma3_text"):
        model = AutoModelForCausalLM.from_pretrained(family_dir(family), dtype=torch.float32)
        decoder = StaticDecoder(model)
        decoder.reserve(5, 200)
        assert (decoder.slots, decoder.columns) == (8, 256)
        assert decoder.cache_bytes == 8 * 256 * portable_sampling.cache_bytes_per_token(model), family


def test_a_model_with_fused_qkv_is_sized_from_its_config():
    """A family outside the listed ones (Phi-3: one qkv projection) still runs on the portable path's dynamic
    cache: its cache is sized from the config, kv heads × head dim for k and for v, per layer."""
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=100, pad_token_id=0)
    model = Phi3ForCausalLM(config).to(torch.bfloat16)
    assert not hasattr(model.get_decoder().layers[0].self_attn, "k_proj")
    assert portable_sampling.cache_bytes_per_token(model) == 3 * 2 * 2 * 16 * 2


@pytest.mark.parametrize("family", ["phi3", "deepseek_v3_moe", "minicpm3", "falcon"])
def test_the_bytes_per_token_of_families_sized_from_their_config_are_what_transformers_caches(family):
    """Fused qkv (Phi-3), latent attention (DeepSeek-V3, MiniCPM3: keys and values cached expanded, values of
    their own head size) and a decoder whose layers are not ``layers`` (Falcon's ``h``, with its own name for the
    kv heads): cache_bytes_per_token is what transformers' dynamic cache holds per token of a prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(family_dir(family), dtype=torch.float32)
    prompt = torch.arange(1, 12)[None]
    with torch.no_grad():
        cache = model(input_ids=prompt, use_cache=True).past_key_values
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert portable_sampling.cache_bytes_per_token(model) * prompt.shape[1] == held
