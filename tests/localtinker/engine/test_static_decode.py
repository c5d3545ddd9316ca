"""static_decode.py, run eagerly on the CPU (the GPU replays the same step as CUDA graphs; test_cuda.py): the
portable sampler over the static cache draws the same tokens, with the same logprobs (float32 ≤ 1e-5), as over
transformers' dynamic cache — with requests joining mid-decode, rows finishing at different steps (slot
compaction), the cache growing past its first column bucket, one pooled decoder serving several adapters
and the bare base model in turn, and adapters of different factors decoding at once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from localtinker.engine.api import LoraSpec, SampleSpec
from localtinker.engine.engine import LocalEngine
from localtinker.engine.static_decode import (
    JOINED_ENV, MIN_COLUMNS, StaticDecoder, bucket, joined_by_default, static_decode_supported,
)
from tests.localtinker.engine.families import FAMILIES, family_dir
from tests.localtinker.engine.reference import TINY

LORA = LoraSpec(rank=4, seed=5)
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[str, LocalEngine]:
    return {
        "static": LocalEngine(tmp_path_factory.mktemp("static"), dtype="float32", portable=True, static_decode=True),
        "dynamic": LocalEngine(tmp_path_factory.mktemp("dynamic"), dtype="float32", portable=True, static_decode=False),
    }


def _trained(engine: LocalEngine, model_id: str, seed: int, lora: LoraSpec = LORA) -> str:
    """A model whose adapter is not the identity (random B), and an ephemeral sampler of it."""
    engine.create_model(model_id, TINY, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, param in engine._models[model_id].params.items():
            if key.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    sampler = f"sampler-{model_id}"
    engine.create_ephemeral_sampler(sampler, model_id)
    return sampler


def _pool(engine: LocalEngine) -> list[StaticDecoder]:
    host = engine._hosts.get(TINY)  # (none before the engine's first model)
    return [] if host is None else host.base.model.__dict__.get("_localtinker_static_decoders", [])


@pytest.fixture(params=["separate", "joined"])
def joined(request, engines, monkeypatch) -> str:
    """The test runs with the decoders' A factors as products of their own, then joined to copies of the base
    weights (static_decode._Joined: a GPU's default for a small model); the static engine's pool starts empty and
    every decoder the test left there has the mode asked for."""
    monkeypatch.setenv(JOINED_ENV, "1" if request.param == "joined" else "0")
    _pool(engines["static"]).clear()
    yield request.param
    for decoder in _pool(engines["static"]):
        assert decoder.joined == (request.param == "joined")
        for projections in decoder.projections:
            for projection in projections.values():
                weight, _, a, b_t = projection.parts()
                assert (a is None) == (request.param == "joined")  # joined: A sits in the weight's last rows
                assert weight.shape[0] == b_t.shape[1] + (b_t.shape[0] if request.param == "joined" else 0)
    _pool(engines["static"]).clear()


def _assert_same(static_results, dynamic_results) -> None:
    for ours, theirs in zip(static_results, dynamic_results):
        assert not isinstance(ours, Exception) and not isinstance(theirs, Exception), (ours, theirs)
        assert [s.tokens for s in ours.sequences] == [s.tokens for s in theirs.sequences]
        assert [s.stop_reason for s in ours.sequences] == [s.stop_reason for s in theirs.sequences]
        for a, b in zip(ours.sequences, theirs.sequences):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=TOLERANCE, rtol=0)
        assert (ours.prompt_logprobs is None) == (theirs.prompt_logprobs is None)
        if ours.prompt_logprobs is not None:
            assert ours.prompt_logprobs[0] is None and theirs.prompt_logprobs[0] is None
            np.testing.assert_allclose(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:], atol=TOLERANCE, rtol=0)


def test_joins_compaction_and_growth_equal_the_dynamic_cache(engines, joined):
    """A long request crosses the first column bucket (the cache grows), short ones join mid-decode and
    leave early (their slots are compacted away), one stops on a stop token."""
    long = SampleSpec(prompt_tokens=tuple(range(100, 130)), num_samples=3, max_tokens=MIN_COLUMNS + 20, seed=1,
                      stop_token_ids=())
    short = SampleSpec(prompt_tokens=tuple(range(300, 305)), num_samples=2, max_tokens=4, seed=2, stop_token_ids=())
    late = SampleSpec(prompt_tokens=tuple(range(700, 719)), num_samples=2, max_tokens=9, seed=3, stop_token_ids=(),
                      temperature=0.7, top_p=0.9)
    results = {}
    for name, engine in engines.items():
        sampler = _trained(engine, f"{name}:train:joins:{joined}", seed=1)
        stream = engine.sample_stream()
        stream.submit("long", sampler, long)
        done = {}
        for step in range(400):
            if step == 2:
                stream.submit("short", sampler, short)
            if step == 5:
                stream.submit("late", sampler, late)
            done.update(dict(stream.step()))
            if not stream.busy:
                break
        assert set(done) == {"long", "short", "late"}
        results[name] = [done["long"], done["short"], done["late"]]
    _assert_same(results["static"], results["dynamic"])
    assert [len(s.tokens) for s in results["static"][0].sequences] == [long.max_tokens] * 3
    (decoder,) = _pool(engines["static"])  # the static path ran, and its cache grew past one bucket
    assert decoder.columns == bucket(len(long.prompt_tokens) + long.max_tokens, MIN_COLUMNS) > MIN_COLUMNS
    assert not _pool(engines["dynamic"])


def test_stop_tokens_and_greedy_rows_leave_their_slots(engines):
    prompt = tuple(range(50, 60))
    results = {}
    for name, engine in engines.items():
        sampler = _trained(engine, f"{name}:train:stops", seed=2)
        greedy = engine.sample_batch([(sampler, SampleSpec(prompt_tokens=prompt, max_tokens=8, temperature=0.0,
                                                           stop_token_ids=()))])[0]
        stop_at = greedy.sequences[0].tokens[3]
        results[name] = engine.sample_batch([
            (sampler, SampleSpec(prompt_tokens=prompt, max_tokens=8, temperature=0.0, stop_token_ids=(stop_at,))),
            (sampler, SampleSpec(prompt_tokens=prompt[:7], num_samples=4, max_tokens=8, seed=9, stop_token_ids=())),
        ])
        assert results[name][0].sequences[0].stop_reason == "stop"
    _assert_same(results["static"], results["dynamic"])


def test_prompts_prefilled_once_with_their_logprobs_equal_the_dynamic_cache(engines):
    """The static decoder prefills each distinct prompt once, packed without padding, and writes its keys
    and values into every sample's slot: prompt logprobs, a request of no new tokens, and two requests of one
    prompt among prompts of other lengths sample as over the dynamic cache."""
    prompt = tuple(range(200, 223))
    specs = [SampleSpec(prompt_tokens=prompt, num_samples=3, max_tokens=6, seed=1, prompt_logprobs=True,
                        stop_token_ids=()),
             SampleSpec(prompt_tokens=tuple(range(500, 507)), max_tokens=0, prompt_logprobs=True, stop_token_ids=()),
             SampleSpec(prompt_tokens=prompt, num_samples=2, max_tokens=5, seed=2, stop_token_ids=()),
             SampleSpec(prompt_tokens=tuple(range(600, 640)), max_tokens=7, seed=3, stop_token_ids=())]
    results = {}
    for name, engine in engines.items():
        sampler = _trained(engine, f"{name}:train:prefill", seed=5)
        results[name] = engine.sample_batch([(sampler, spec) for spec in specs])
    _assert_same(results["static"], results["dynamic"])
    assert results["static"][1].sequences[0].tokens == [] and len(results["static"][1].prompt_logprobs) == 7
    assert len(results["static"][0].prompt_logprobs) == len(prompt)


def test_one_pooled_decoder_serves_adapters_and_the_base_model_in_turn(engines, joined):
    """Two adapters decoding at once take two decoders; later calls reuse them with the other adapter's
    factors (or none, for the base model) copied in."""
    specs = [SampleSpec(prompt_tokens=tuple(range(10 + k, 30 + k)), num_samples=2, max_tokens=6, seed=k,
                        stop_token_ids=()) for k in range(3)]
    results = {}
    for name, engine in engines.items():
        first = _trained(engine, f"{name}:train:first:{joined}", seed=3)
        second = _trained(engine, f"{name}:train:second:{joined}", seed=4)
        engine.create_sampler(f"{name}-base-{joined}", TINY, None)
        together = engine.sample_batch([(first, specs[0]), (second, specs[1])])
        alone = engine.sample_batch([(second, specs[2]), (first, specs[2])])
        base = engine.sample_batch([(f"{name}-base-{joined}", specs[0])])
        results[name] = together + alone + base
    _assert_same(results["static"], results["dynamic"])
    assert len(_pool(engines["static"])) == 2
    # the adapters changed the samples: a decoder that kept stale factors would have been caught above
    assert results["static"][0].sequences[0].tokens != results["static"][4].sequences[0].tokens


def test_adapters_decoding_at_once_keep_their_own_factors(engines, joined):
    """Batches of different adapters step in turn, each on its own decoder: adapters of different A factors (and
    ranks) give each its own samples, as over the dynamic cache — a factor one decoder shares with another (the
    base weights are shared) would give one of them the other's."""
    specs = [SampleSpec(prompt_tokens=tuple(range(40 + k, 60 + k)), num_samples=2, max_tokens=12, seed=k,
                        stop_token_ids=()) for k in range(2)]
    results = {}
    for name, engine in engines.items():
        first = _trained(engine, f"{name}:train:own-a:{joined}", seed=6, lora=LoraSpec(rank=4, seed=11))
        second = _trained(engine, f"{name}:train:own-b:{joined}", seed=7, lora=LoraSpec(rank=4, seed=12))
        third = _trained(engine, f"{name}:train:own-c:{joined}", seed=8, lora=LoraSpec(rank=8, seed=13))
        results[name] = engine.sample_batch([(first, specs[0]), (second, specs[1]), (third, specs[0]),
                                             (first, specs[1])])
    _assert_same(results["static"], results["dynamic"])


@pytest.mark.parametrize("family", FAMILIES)
def test_supported_families(family):
    model = AutoModelForCausalLM.from_pretrained(family_dir(family), dtype=torch.float32)
    assert static_decode_supported(model) == (family in {"llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "gpt_oss",
                                                           "gemma2", "gemma3_text"})
    assert static_decode_supported(model, moe=False) == (family in {"llama", "qwen2", "qwen3", "mistral", "gemma2",
                                                                    "gemma3_text"})


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "gemma2", "gemma3_text"])
def test_other_layer_shapes_decode_as_over_the_dynamic_cache(engines, family):
    """Qwen3-MoE and gpt-oss: each layer's MoE block runs as its own module inside the static step (router,
    experts and the experts' LoRA); gpt-oss's sliding-window layers (a window of 8 here, passed in prefill and in
    decode) and its attention sinks too. Gemma 2 and 3: four norms of weight 1 + w per layer, a GELU gate, soft
    caps on the attention scores (Gemma 2) and the logits, Gemma 3's full and sliding layers each rotated by its
    own frequencies. Adapters on the MLP (or experts) and on attention only, and the base model, decode the tokens
    and logprobs transformers' layers decode over the dynamic cache, one pooled decoder serving them in turn."""
    base = str(family_dir(family))
    # The Gemma fixtures cap their logits at 3, so their next-token distributions are nearly flat over 49152
    # tokens: a sampled draw lands within float32 rounding of a token's edge often enough that the two paths'
    # 1e-6 differences pick a neighbouring token. Greedy rows compare the same arithmetic without edges.
    temperature = 0.0 if family.startswith("gemma") else 1.0
    specs = [SampleSpec(prompt_tokens=(1, 17, 300, 4000, 22), num_samples=3, max_tokens=10, seed=3,
                        stop_token_ids=(), prompt_logprobs=True, temperature=temperature),
             SampleSpec(prompt_tokens=(9, 8, 7), num_samples=2, max_tokens=7, seed=4, stop_token_ids=(),
                        temperature=temperature),
             SampleSpec(prompt_tokens=tuple(range(100, 112)), num_samples=1, max_tokens=6, seed=5,
                        stop_token_ids=(), prompt_logprobs=True, temperature=temperature)]
    results = {}
    for name, engine in engines.items():
        samplers = []
        for index, lora in enumerate((LoraSpec(rank=4, seed=21), LoraSpec(rank=4, seed=22, train_mlp=False))):
            model_id = f"{name}:train:{family}-{index}"
            engine.create_model(model_id, base, lora)
            generator = torch.Generator().manual_seed(30 + index)
            with torch.no_grad():
                for key, param in engine._models[model_id].params.items():
                    if key.endswith("lora_B"):
                        param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
            engine.create_ephemeral_sampler(f"sampler-{family}-{index}-{name}", model_id)
            samplers.append(f"sampler-{family}-{index}-{name}")
        engine.create_sampler(f"sampler-{family}-base-{name}", base, None)
        samplers.append(f"sampler-{family}-base-{name}")
        results[name] = [result for sampler in samplers
                         for result in engine.sample_batch([(sampler, spec) for spec in specs])]
    _assert_same(results["static"], results["dynamic"])
    model = engines["static"]._hosts[base].base.model
    pooled = model.__dict__.get("_localtinker_static_decoders", [])
    assert pooled and all(decoder.sandwich == family.startswith("gemma") for decoder in pooled)
    assert all((moe is not None) == family.endswith(("moe", "oss")) for decoder in pooled for moe in decoder.moe)


def test_new_expert_factors_drop_the_captured_graphs():
    """A captured step holds the experts' LoRA factors it was captured with: loading other ones, or the same
    ones updated in place (a new snapshot), drops the graphs; loading the same ones again keeps them."""
    from localtinker.engine.lora import AdapterHost

    model = AutoModelForCausalLM.from_pretrained(family_dir("qwen3_moe"), dtype=torch.float32)
    host = AdapterHost(model)
    first, second = host.add_adapter(LoraSpec(rank=4, seed=0), 0), host.add_adapter(LoraSpec(rank=4, seed=1), 1)
    decoder = StaticDecoder(model)
    decoder.set_adapter(first)
    decoder._graphs[(8, MIN_COLUMNS, False)] = (None, None)  # a stand-in for a captured graph
    decoder.set_adapter(first)
    assert decoder.captured_graphs == 1
    with torch.no_grad():
        host.parameters(first)["model.layers.0.mlp.experts.down_proj.lora_B"].add_(0.1)
    decoder.set_adapter(first)
    assert decoder.captured_graphs == 0
    decoder._graphs[(8, MIN_COLUMNS, False)] = (None, None)
    decoder.set_adapter(second)
    assert decoder.captured_graphs == 0


def test_step_refuses_rows_beyond_its_reservation():
    model = AutoModelForCausalLM.from_pretrained(family_dir("llama"), dtype=torch.float32)
    decoder = StaticDecoder(model)
    decoder.reserve(2, 10)
    assert (decoder.slots, decoder.columns) == (8, MIN_COLUMNS)
    with pytest.raises(ValueError, match="exceed the reserved 8 × 128"):
        decoder.step(2, MIN_COLUMNS)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v carry biases
def test_shared_input_products_reuse_the_trainers_weights(family):
    """q/k/v and gate/up run as one product each over one tensor that the modules' own weights become views
    of: no parameter memory is added, the trainer's forward and gradients are unchanged, and a second decoder
    of the model finds the same tensor instead of concatenating again."""
    model = AutoModelForCausalLM.from_pretrained(family_dir(family), dtype=torch.float32)
    ids = torch.arange(3, 40)[None]
    before = model(input_ids=ids).logits
    before.sum().backward()
    grad_before = model.model.layers[0].self_attn.k_proj.weight.grad.clone()
    model.zero_grad()
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    bytes_before = sum(p.numel() * p.element_size() for p in model.parameters())

    decoder = StaticDecoder(model)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    qkv, gate_up = decoder.projections[0]["qkv"], decoder.projections[0]["gate_up"]
    assert (qkv.bias is not None) == (family == "qwen2")
    for shared, modules in ((qkv, (attention.q_proj, attention.k_proj, attention.v_proj)),
                            (gate_up, (mlp.gate_proj, mlp.up_proj))):
        assert torch.equal(shared.weight, torch.cat([m.weight for m in modules]))
        assert {m.weight.untyped_storage().data_ptr() for m in modules} == {shared.weight.untyped_storage().data_ptr()}
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) < len(storages)
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == bytes_before

    after = model(input_ids=ids).logits
    after.sum().backward()
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)
    torch.testing.assert_close(attention.k_proj.weight.grad, grad_before, atol=1e-6, rtol=1e-6)
    assert StaticDecoder(model).projections[0]["qkv"].weight is qkv.weight


@torch.inference_mode()  # the decoder's buffers are inference tensors, written in place as the sampler does
def test_the_queued_step_chooses_as_the_host_does():
    """The choosing step (tokens drawn inside the step from per-slot uniforms and temperatures, positions moved
    on for live slots only) picks what token_choice picks from the same step's logits and uniforms."""
    from localtinker.engine.sampler import SampleRow
    from localtinker.engine.token_choice import choose_tokens_on_device

    model = AutoModelForCausalLM.from_pretrained(family_dir("llama"), dtype=torch.float32)
    decoder = StaticDecoder(model)
    decoder.reserve(3, 20)
    decoder.tokens[:3] = torch.tensor([11, 12, 13])
    decoder.positions[:3] = torch.tensor([0, 0, 0])
    temperatures = [1.0, 0.6, 0.0]
    rows = [SampleRow(request=None, temperature=t, top_k=0, top_p=1.0, max_tokens=4, stop_ids=(), stop_strings=(),
                      generator=torch.Generator().manual_seed(i)) for i, t in enumerate(temperatures)]
    expected_tokens, expected_logprobs = choose_tokens_on_device(decoder.step(3, 0).clone(), rows)
    rows = [SampleRow(request=None, temperature=t, top_k=0, top_p=1.0, max_tokens=4, stop_ids=(), stop_strings=(),
                      generator=torch.Generator().manual_seed(i)) for i, t in enumerate(temperatures)]
    uniforms = [row.next_uniform() for row in rows]
    decoder.controls[:, :4] = torch.tensor([[*uniforms, 0.0], [1.0, 0.6, 1.0, 1.0], [0, 0, 1, 0], [1, 1, 1, 0]])
    decoder.step_and_choose(3, 0)
    assert decoder.tokens[:3].tolist() == expected_tokens.tolist()
    torch.testing.assert_close(decoder.chosen_logprobs[:3], expected_logprobs, atol=1e-6, rtol=0)
    assert decoder.positions[:4].tolist() == [1, 1, 1, 0]  # the free slot in the bucket stays put


@torch.inference_mode()
def test_sdpa_attention_decodes_as_the_two_products(monkeypatch):
    """``LOCALTINKER_DECODE_ATTENTION=sdpa`` (opt-in: one memory-efficient kernel per layer on a GPU, the hidden
    columns as an additive bias) computes a step's attention as the two products and the softmax do, for rows at
    different positions, across steps (the CPU runs sdpa's own kernel on the same call)."""
    model = AutoModelForCausalLM.from_pretrained(family_dir("qwen3"), dtype=torch.float32)
    products = StaticDecoder(model)
    monkeypatch.setenv("LOCALTINKER_DECODE_ATTENTION", "sdpa")
    sdpa = StaticDecoder(model)
    assert sdpa.sdpa_attention and not products.sdpa_attention
    for decoder in (products, sdpa):
        decoder.set_adapter(None)
        decoder.reserve(5, 12)
        decoder.tokens[:5] = torch.tensor([11, 12, 13, 14, 15])
        decoder.positions[:5] = torch.tensor([0, 2, 4, 1, 3])
    for step in range(4):
        logits = [decoder.step(5, 4 + step) for decoder in (products, sdpa)]
        torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)
        for decoder in (products, sdpa):
            decoder.tokens[:5] = logits[0].argmax(-1)
            decoder.positions[:5] += 1


def test_the_compiled_in_step_choice_draws_what_the_eager_one_draws():
    """On a GPU the in-step token choice is compiled with the layer pieces; the CPU's compiler checks here that it
    draws the same tokens with the same logprobs — sampled rows at several temperatures, a greedy row, and a row
    whose top-end weights are zero drawn at the very end of its distribution (the last positive token, never a
    zero-weight one)."""
    from localtinker.engine.decode_layer import compiled_once
    from localtinker.engine.token_choice import choose_in_step

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn((6, 1000), generator=generator) * 3
    logits[5, 900:] = float("-inf")
    uniforms = torch.rand(6, generator=generator)
    uniforms[5] = 1.0
    temperatures = torch.tensor([1.0, 0.5, 1.7, 1.0, 1.0, 1.0])
    greedy = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    eager = choose_in_step(logits, uniforms, temperatures, greedy)
    compiled = compiled_once(choose_in_step)(logits, uniforms, temperatures, greedy)
    assert compiled[0].tolist() == eager[0].tolist()
    torch.testing.assert_close(compiled[1], eager[1], atol=1e-6, rtol=0)
    assert eager[0][3] == logits[3].argmax() and eager[0][5] == 899
    expected = (logits / temperatures[:, None]).log_softmax(-1).gather(-1, eager[0][:, None]).squeeze(-1)
    torch.testing.assert_close(eager[1], expected)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # qwen2: q/k/v biases (joined with zeros for A's rows)
@torch.inference_mode()
def test_compiled_joined_weights_decode_as_uncompiled_separate_products(family):
    """A GPU decoder of a small model joins the adapter's A rows to copies of the base weights and compiles
    the pieces; here the CPU's compiler runs that against the op-by-op step with A as products of its own,
    with an adapter whose factors are all non-zero."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(family_dir(family), dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets)).base_model.model
    generator = torch.Generator().manual_seed(0)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    decoders = [StaticDecoder(model, compiled=False, joined=False), StaticDecoder(model, compiled=True, joined=True)]
    for decoder in decoders:
        decoder.set_adapter("default")
        decoder.reserve(5, 12)
        decoder.tokens[:5] = torch.tensor([11, 12, 13, 14, 15])
    assert decoders[1].projections[0]["qkv"].parts()[2] is None  # joined: no A of its own
    for step, rows in enumerate((5, 5, 3)):
        if step == 2:  # the cache grows (more slots and columns): the compiled piece writes into the new one
            for decoder in decoders:
                decoder.reserve(20, MIN_COLUMNS + 1)
        logits = [decoder.step(rows, step) for decoder in decoders]
        torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)
        for decoder in decoders:
            decoder.tokens[:rows] = logits[0].argmax(-1)
            decoder.positions[:rows] += 1
    for decoder in decoders:  # then a step that chooses its tokens (compiled too), three rows sampled, one greedy
        decoder.controls[:, :4] = torch.tensor([[0.2, 0.5, 0.9, 0.0], [1.0, 0.7, 1.0, 1.0], [0, 0, 1, 0],
                                                [1, 1, 1, 0]])
        decoder.step_and_choose(3, 3)
    assert decoders[1].tokens[:3].tolist() == decoders[0].tokens[:3].tolist()
    torch.testing.assert_close(decoders[1].chosen_logprobs[:3], decoders[0].chosen_logprobs[:3], atol=1e-5, rtol=0)
    assert decoders[1].compiled and decoders[1].compile_error is None


# qwen3: q/k norms, every piece of the layer compiled; gpt_oss: sinks in the softmax, past its window of 8;
# gemma3_text: norms of weight 1 + w (q/k too), the norms around attention and MLP, two rotation tables (~9 s of
# compiling here)
@pytest.mark.parametrize("family", ["qwen3", "gpt_oss", "gemma3_text"])
@torch.inference_mode()
def test_compiled_layer_pieces_decode_as_the_uncompiled_ones(family):
    """The GPU compiles the layer pieces (decode_layer.py); the CPU's compiler checks here that the traced
    pieces compute what the op-by-op ones do, step after step, across a change of row bucket."""
    model = AutoModelForCausalLM.from_pretrained(family_dir(family), dtype=torch.float32)
    decoders = [StaticDecoder(model, compiled=False), StaticDecoder(model, compiled=True)]
    for decoder in decoders:
        decoder.set_adapter(None)
        decoder.reserve(5, 16)
        decoder.tokens[:5] = torch.tensor([11, 12, 13, 14, 15])
    for step, rows in enumerate((5,) * 9 + (2, 2)):  # 8 rows wide, then 2
        logits = [decoder.step(rows, step) for decoder in decoders]
        torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)
        for decoder in decoders:
            decoder.tokens[:rows] = logits[0].argmax(-1)
            decoder.positions[:rows] += 1
    assert decoders[1].compiled and decoders[1].compile_error is None


def test_weights_are_joined_by_default_for_a_small_model_on_a_card_with_room(monkeypatch):
    """The default on a CUDA card (a faked one: its memory is all the decision reads): a 1B shape's layer weights
    (~1.9 GB) are copied and joined on an 80 GiB card, the 8B shape's 14 GB are not, nor the 1B's on a card with
    6 GiB free; never on the CPU; ``LOCALTINKER_DECODE_JOINED`` decides over all of it."""
    gib = 1 << 30
    free = {"now": 80 * gib}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["now"], 80 * gib))
    monkeypatch.delenv(JOINED_ENV, raising=False)
    cuda, small, large = torch.device("cuda"), int(1.9 * gib), 14 * gib
    assert joined_by_default(cuda, small) and not joined_by_default(cuda, large)
    assert not joined_by_default(torch.device("cpu"), small)
    free["now"] = 6 * gib  # a quarter of the free memory is less than the copies
    assert not joined_by_default(cuda, small)
    monkeypatch.setenv(JOINED_ENV, "1")
    assert joined_by_default(cuda, large) and joined_by_default(torch.device("cpu"), small)
    monkeypatch.setenv(JOINED_ENV, "0")
    free["now"] = 80 * gib
    assert not joined_by_default(cuda, small)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss", "mistral_sliding"])
def test_sdpa_attention_is_taken_only_where_sdpa_computes_the_layer(monkeypatch, family):
    """Asked for, the sdpa decode attention is taken by a plain model only: sdpa has no soft cap on the scores
    (Gemma 2), no sinks (gpt-oss) and no window mask of its own (the products keep the second mask)."""
    model = AutoModelForCausalLM.from_pretrained(family_dir(family), dtype=torch.float32)
    monkeypatch.setenv("LOCALTINKER_DECODE_ATTENTION", "sdpa")
    assert StaticDecoder(model, compiled=False).sdpa_attention == (family == "llama")
    monkeypatch.delenv("LOCALTINKER_DECODE_ATTENTION")
    assert not StaticDecoder(model, compiled=False).sdpa_attention


def test_a_released_decoder_keeps_its_cache_only_while_the_pool_stays_within_an_eighth_of_the_memory(monkeypatch):
    """Between batches the pool keeps up to two decoders (their graphs are reused), but not a cache that would
    hold more than 1/8 of the device's memory under the next training step: on the CPU too, whose RAM (faked
    here) a burst's cache would otherwise keep."""
    from transformers import AutoModelForCausalLM

    from localtinker.engine import static_decode
    from localtinker.engine.static_decode import StaticDecoder, pooled_decoders
    from tests.localtinker.engine.families import family_dir

    model = AutoModelForCausalLM.from_pretrained(family_dir("llama"), dtype=torch.float32)
    small, large = StaticDecoder(model), StaticDecoder(model)
    small.reserve(8, 128)
    large.reserve(64, 1024)
    monkeypatch.setattr(static_decode, "total_bytes", lambda device: 8 * large.cache_bytes - 8)
    large.release()
    assert pooled_decoders(model) == []  # its cache alone is more than an eighth
    small.release()
    assert pooled_decoders(model) == [small]
    monkeypatch.setattr(static_decode, "total_bytes", lambda device: None)  # memory unknown: kept
    large.release()
    assert pooled_decoders(model) == [small, large]
