"""packed_layers.py on the CPU (a GPU runs the same code compiled; test_cuda.py): the written-out layers give the
hidden states and LoRA gradients of transformers' layers on packed rows (float32 ≤ 1e-5), for the families they
take and with or without an adapter; the compiled pieces (inductor's C++ backend here) compute what the op-by-op
ones do, one graph for every token count; a compiler failure leaves the path uncompiled and the step correct,
and the compile probe keeps gradients accumulated so far. The trainer's end-to-end equality with transformers +
peft for every family on this path is test_families.py's ``cuda-path`` engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localtinker.engine.api import LoraSpec
from localtinker.engine.engine import LocalEngine
from localtinker.engine.packed_layers import (
    GRAPHS_ENV, LAYERS_ENV, PackedLayers, graphs_by_default, layers_by_default, token_bucket,
)
from localtinker.engine.packed_layout import PackedLayout, packed_batches
from localtinker.engine.packed_rows import packed_rows
from tests.localtinker.engine.families import FAMILIES, SLIDING_FAMILIES, family_dir
from tests.localtinker.engine.test_families import _datum

TOLERANCE = 1e-5
WRITTEN_OUT = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "gpt_oss", "gemma2", "gemma3_text")
LENGTHS = (7, 19, 3)


def _engine(tmp_path, family: str, lora: LoraSpec | None = None, **kwargs) -> tuple[LocalEngine, str]:
    engine = LocalEngine(tmp_path / family, dtype="float32", portable=True, static_decode=False, **kwargs)
    model_id = f"layers:{family}"
    lora = lora or LoraSpec(rank=4, seed=0)
    engine.create_model(model_id, str(family_dir(family)), lora)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():  # B starts at zero: make the adapter change the output
        for key, param in engine._models[model_id].params.items():
            if key.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return engine, model_id


def _tokens(seed: int = 0, lengths: tuple[int, ...] = LENGTHS) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.as_tensor(rng.integers(0, 49152, size=n)) for n in lengths]


def _assert_grads_close(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], exact: bool = False) -> None:
    """Gradients equal within float32 rounding of their own scale (a sum over tokens reaches ~100 here)."""
    assert set(ours) == set(theirs)
    for key, expected in theirs.items():
        scale = 0.0 if exact else TOLERANCE * float(expected.abs().max())
        torch.testing.assert_close(ours[key], expected, atol=scale, rtol=0, msg=key)


def _hidden_and_grads(engine: LocalEngine, model_id: str, layers: PackedLayers | None, adapter: bool = True,
                      tokens: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Hidden states of packed rows and the gradients of a fixed function of them."""
    model = engine._models[model_id]
    host = engine._hosts[model.base_name]
    tokens = _tokens() if tokens is None else tokens
    for param in model.params.values():
        param.grad = None
    with host.adapters.activated(model.adapter if adapter else None):
        [batch] = packed_batches(tokens, tokens, budget=10**6, share=False)
        rows = packed_rows(host.base.model.get_decoder(), batch, torch.device("cpu"), layers)
        weights = torch.linspace(-1, 1, rows.hidden.shape[-1])
        if rows.hidden.requires_grad:  # the bare model has nothing to train
            (rows.hidden * weights).sum().backward()
    return rows.hidden.detach(), {k: p.grad.clone() for k, p in model.params.items() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_families_taken_are_the_llama_shaped_ones(tmp_path, family):
    engine, model_id = _engine(tmp_path, family, train_layers=True)
    assert (PackedLayers.for_model(engine._hosts[str(family_dir(family))].base.model) is not None) == (
        family in WRITTEN_OUT)


@pytest.mark.parametrize("family", WRITTEN_OUT)
@pytest.mark.parametrize("adapter", [True, False], ids=["adapter", "bare"])
def test_hidden_states_and_gradients_equal_transformers_layers(tmp_path, family, adapter):
    engine, model_id = _engine(tmp_path, family)
    layers = PackedLayers(engine._hosts[str(family_dir(family))].base.model, compiled=False)
    ours, our_grads = _hidden_and_grads(engine, model_id, layers, adapter)
    theirs, their_grads = _hidden_and_grads(engine, model_id, None, adapter)
    torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)
    assert bool(their_grads) == adapter
    _assert_grads_close(our_grads, their_grads)


@pytest.mark.parametrize("lora", [LoraSpec(rank=3, seed=1, train_attn=False), LoraSpec(rank=3, seed=1, train_mlp=False),
                                  LoraSpec(rank=3, seed=1, train_attn=False, train_mlp=False)],
                         ids=["mlp-only", "attention-only", "unembedding-only"])
def test_adapters_on_some_layer_groups_only(tmp_path, lora):
    """Groups the adapter leaves alone run their base product only; the others still get their gradients."""
    engine, model_id = _engine(tmp_path, "qwen2", lora)  # q/k/v biases
    layers = PackedLayers(engine._hosts[str(family_dir("qwen2"))].base.model, compiled=False)
    ours, our_grads = _hidden_and_grads(engine, model_id, layers)
    theirs, their_grads = _hidden_and_grads(engine, model_id, None)
    torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)
    _assert_grads_close(our_grads, their_grads)
    assert bool(their_grads) == (lora.train_attn or lora.train_mlp)


def test_an_adapter_this_path_cannot_compute_runs_transformers_layers(tmp_path):
    """Dropout on the adapter: the layers decline (None), packed_rows then runs transformers' layers."""
    engine, model_id = _engine(tmp_path, "llama")
    model = engine._models[model_id]
    base = engine._hosts[model.base_name].base.model
    layers = PackedLayers(base, compiled=False)
    q_proj = base.get_decoder().layers[0].self_attn.q_proj
    q_proj.lora_dropout[model.adapter] = torch.nn.Dropout(0.0)
    tokens = _tokens()
    with engine._hosts[model.base_name].adapters.activated(model.adapter):
        positions = torch.cat([torch.arange(n) for n in LENGTHS])
        layout = PackedLayout.rows(list(LENGTHS), torch.device("cpu"))
        assert layers.hidden(torch.cat(tokens), positions, layout) is None
    ours, _ = _hidden_and_grads(engine, model_id, layers)
    theirs, _ = _hidden_and_grads(engine, model_id, None)
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
def test_sliding_windows_in_the_layers_equal_transformers_windowed_layers(tmp_path, family):
    """A window of 8 (Mistral's on every layer, Qwen2's on its second): each layer passes its own window to the
    packed attention, so datums longer than it get the hidden states and gradients of transformers' windowed
    layers (the trainer's equality with the model's own forward is test_families.py's)."""
    engine, model_id = _engine(tmp_path, family, train_layers=True)
    layers = PackedLayers.for_model(engine._hosts[str(family_dir(family))].base.model)
    assert layers is not None and 8 in layers.windows
    tokens = _tokens(1, (19, 8, 3))
    ours, our_grads = _hidden_and_grads(engine, model_id, layers, tokens=tokens)
    theirs, their_grads = _hidden_and_grads(engine, model_id, None, tokens=tokens)
    torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)
    _assert_grads_close(our_grads, their_grads)


def test_the_engine_trains_through_the_layers_when_asked(tmp_path, monkeypatch):
    """``train_layers=True`` routes forward_backward through PackedLayers; the default on a CPU does not."""
    calls = []
    original = PackedLayers.hidden
    monkeypatch.setattr(PackedLayers, "hidden", lambda self, *a: calls.append(1) or original(self, *a))
    datums = [_datum(t.numpy()) for t in _tokens()]
    for flag, expected in ((None, 0), (True, 2)):
        calls.clear()
        engine, model_id = _engine(tmp_path / str(flag), "qwen3", train_layers=flag)
        engine.forward_backward(model_id, datums, "cross_entropy", None, False)
        engine.forward_backward(model_id, datums, "cross_entropy", None, True)
        assert len(calls) == expected


def test_a_failing_compiler_leaves_the_layers_uncompiled_and_correct(tmp_path, monkeypatch):
    engine, model_id = _engine(tmp_path, "qwen2")
    base = engine._hosts[str(family_dir("qwen2"))].base.model
    layers = PackedLayers(base, compiled=False)
    theirs, their_grads = _hidden_and_grads(engine, model_id, layers)

    def broken(*args, **kwargs):
        raise RuntimeError("inductor: no C++ compiler\nsecond line")

    failing = PackedLayers(base, compiled=False)
    failing.compiled, failing._probed = True, False
    failing._pieces = (broken,) * 4
    with pytest.warns(RuntimeWarning, match="compiling the training layers failed"):
        ours, our_grads = _hidden_and_grads(engine, model_id, failing)
    assert not failing.compiled and failing.compile_error == "RuntimeError: inductor: no C++ compiler"
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    _assert_grads_close(our_grads, their_grads, exact=True)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])  # qwen3_moe: the experts' factors too
def test_the_compile_probe_keeps_the_gradients_accumulated_so_far(tmp_path, family):
    engine, model_id = _engine(tmp_path, family)
    model = engine._models[model_id]
    base = engine._hosts[model.base_name].base.model
    layers = PackedLayers(base, compiled=False)
    with engine._hosts[model.base_name].adapters.activated(model.adapter):
        for param in model.params.values():
            param.grad = torch.full_like(param, 0.25)
        layers._probed = False
        layers._probe(layers._layer_parts())
    assert all(torch.equal(p.grad, torch.full_like(p, 0.25)) for p in model.params.values())


# qwen3: q/k norms, every part of the dense pieces; qwen3_moe: o_proj's piece before each MoE block; gemma3_text:
# norms of weight 1 + w around attention and MLP, a GELU gate, two rotation tables (~25 s of compiling here)
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "gemma3_text"])
def test_compiled_pieces_train_as_the_uncompiled_ones(tmp_path, family):
    """The GPU compiles the pieces; the CPU's compiler checks here that the traced forward and backward
    compute what the op-by-op ones do, for two token counts through one graph (dynamic in tokens)."""
    from torch._dynamo.utils import counters

    engine, model_id = _engine(tmp_path, family)
    base = engine._hosts[str(family_dir(family))].base.model
    plain, compiled = PackedLayers(base, compiled=False), PackedLayers(base, compiled=True)
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for seed, lengths in ((0, LENGTHS), (1, (11, 30))):
        tokens = _tokens(seed, lengths)
        theirs, their_grads = _hidden_and_grads(engine, model_id, plain, tokens=tokens)
        ours, our_grads = _hidden_and_grads(engine, model_id, compiled, tokens=tokens)
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)
        _assert_grads_close(our_grads, their_grads)
        graphs.append(counters["stats"]["unique_graphs"])
    assert compiled.compiled and compiled.compile_error is None
    # per piece: without autograd, and with it for an input that does (and the first layer's, that does not)
    # require grad — and no new graph for another token count
    assert graphs[0] == graphs[1] <= 6, graphs


def test_token_buckets_cover_every_length_with_little_padding():
    buckets = {token_bucket(n) for n in range(1, 16385)}
    assert len(buckets) <= 25  # a few graphs serve every micro-batch up to the 1B budget
    for n in range(1, 16385):
        assert n <= token_bucket(n) and (n <= 256 or token_bucket(n) <= 1.25 * n)
    assert token_bucket(4096) == 4096 and token_bucket(4097) == 5120


def test_graphed_pieces_pad_to_a_bucket_and_train_as_the_uncompiled_ones(tmp_path):
    """``graphs=True`` (``LOCALTINKER_TRAIN_GRAPHS=1``): on the CPU the compiler skips the CUDA graphs and keeps
    the rest of the path, so this checks the padding to a bucket (plain and shared-prompt layouts), the rows
    returned, and the gradients allocated before the backward — which must add to those of a step so far."""
    engine, model_id = _engine(tmp_path, "llama")
    model = engine._models[model_id]
    host = engine._hosts[model.base_name]
    plain = PackedLayers(host.base.model, compiled=False)
    graphed = PackedLayers(host.base.model, compiled=True, graphs=True)
    assert graphed.graphs and not PackedLayers(host.base.model, compiled=False, graphs=True).graphs
    prompt = _tokens(5, (30,))[0]
    tokens = [torch.cat([prompt, t]) for t in _tokens(6, (5, 9, 4))] + _tokens(7, (13,))
    for share in (False, True):
        [batch] = packed_batches(tokens, tokens, budget=10**6, share=share)
        results = []
        for layers in (plain, graphed):
            for param in model.params.values():
                param.grad = None
            with host.adapters.activated(model.adapter):
                for _ in range(2):  # two micro-batches: the second backward adds to the first one's gradients
                    rows = packed_rows(host.base.model.get_decoder(), batch, torch.device("cpu"), layers)
                    assert rows.hidden.shape[0] == batch.tokens < token_bucket(batch.tokens)
                    (rows.hidden * torch.linspace(-1, 1, rows.hidden.shape[-1])).sum().backward()
            results.append((rows.hidden.detach(), {k: p.grad.clone() for k, p in model.params.items()
                                                   if p.grad is not None}))
        (theirs, their_grads), (ours, our_grads) = results
        assert graphed.compiled and graphed.graphs, graphed.compile_error
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)
        _assert_grads_close({k: g for k, g in our_grads.items() if k in their_grads}, their_grads)
        assert all(not g.any() for k, g in our_grads.items() if k not in their_grads)  # allocated, untouched


def test_failing_graphs_leave_the_pieces_compiled_without_them(tmp_path, monkeypatch):
    engine, model_id = _engine(tmp_path, "llama")
    base = engine._hosts[str(family_dir("llama"))].base.model
    theirs, their_grads = _hidden_and_grads(engine, model_id, PackedLayers(base, compiled=False))
    graphed = PackedLayers(base, compiled=True, graphs=True)

    def broken() -> None:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", broken)
    with pytest.warns(RuntimeWarning, match="as CUDA graphs failed"):
        ours, our_grads = _hidden_and_grads(engine, model_id, graphed)
    assert graphed.compiled and not graphed.graphs and graphed.compile_error.startswith("CUDA graphs: RuntimeError")
    torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)
    _assert_grads_close(our_grads, their_grads)


def test_the_written_out_layers_are_the_cuda_default_and_their_graphs_are_opt_in(monkeypatch):
    """The written-out layers train on a CUDA device unless ``LOCALTINKER_TRAIN_LAYERS=0``, and never by default
    on the CPU (whose own path is tuned); their CUDA graphs only with ``LOCALTINKER_TRAIN_GRAPHS=1``, until
    measured on a GPU."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.delenv(LAYERS_ENV, raising=False)
    monkeypatch.delenv(GRAPHS_ENV, raising=False)
    assert layers_by_default(cuda) and not layers_by_default(cpu)
    assert not graphs_by_default(cuda) and not graphs_by_default(cpu)
    monkeypatch.setenv(LAYERS_ENV, "0")
    monkeypatch.setenv(GRAPHS_ENV, "1")
    assert not layers_by_default(cuda)
    assert graphs_by_default(cuda) and not graphs_by_default(cpu)
