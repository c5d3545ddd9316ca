"""model_memory.py: a base model too large for its device is refused before loading, saying what it needs, what
there is and what to change; the weights' size from the config alone is exact; the free memory is read from the
kernel, a container's limit and the card."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from localtinker.engine import model_memory
from localtinker.engine.api import LoraSpec
from localtinker.engine.engine import LocalEngine
from localtinker.engine.families import load_options
from localtinker.engine.model_memory import ModelTooLargeError, available_bytes, check_weights_fit, weight_bytes
from tests.localtinker.engine.families import FAMILIES, family_dir
from tests.localtinker.engine.reference import sft_datum

GIB = 2**30


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weights_size_from_the_config_alone_is_the_loaded_models(family, dtype):
    """Built on the meta device (nothing allocated, no weight read): the same bytes as the parameters of the
    model loaded as the engine loads it, tied embeddings counted once, MoE experts and sinks included."""
    config = AutoConfig.from_pretrained(family_dir(family))
    loaded = AutoModelForCausalLM.from_pretrained(family_dir(family), dtype=dtype, **load_options(config))
    assert weight_bytes(config, dtype) == sum(p.numel() * p.element_size() for p in loaded.parameters())


def test_an_8b_shaped_config_is_sized_without_memory():
    config = AutoConfig.for_model("llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    assert weight_bytes(config, torch.bfloat16) == 8_030_261_248 * 2  # Llama-3.1-8B's parameter count


def test_a_model_too_large_for_the_machine_is_refused_before_loading_and_the_engine_goes_on(tmp_path, monkeypatch):
    """On the CPU with less memory available than the tiny Llama's 12.3 MiB of float32 weights (faked): creating
    a model on it fails with what it needs, what there is and the remedies; nothing is loaded, and another model
    already served trains on. With the memory back, the same request loads it."""
    engine = LocalEngine(tmp_path, dtype="float32")
    engine.create_model("first", str(family_dir("qwen3")), LoraSpec(rank=4, seed=0))
    name = str(family_dir("llama"))
    need = weight_bytes(AutoConfig.from_pretrained(name), torch.float32)
    monkeypatch.setattr(model_memory, "available_bytes", lambda device: (need - 1, "available on this machine"))
    with pytest.raises(ModelTooLargeError) as refused:
        engine.create_model("second", name, LoraSpec(rank=4, seed=0))
    message = str(refused.value)
    assert f"needs {need / GIB:.1f} GiB for its weights alone in float32" in message
    assert "available on this machine; nothing was loaded" in message
    assert f"bfloat16 weights, {need / 2 / GIB:.1f} GiB (--dtype bfloat16" in message and "a smaller model" in message
    assert name not in engine._hosts and "second" not in engine._models
    result = engine.forward_backward("first", [sft_datum(np.random.default_rng(0), 12)], "cross_entropy", None, False)
    assert np.isfinite(result.loss_fn_outputs[0]["logprobs"]).all()
    monkeypatch.setattr(model_memory, "available_bytes", lambda device: (need, "available on this machine"))
    engine.create_model("second", name, LoraSpec(rank=4, seed=0))
    assert name in engine._hosts


def test_a_card_without_room_for_the_weights_names_its_free_memory(monkeypatch):
    """On a CUDA card (faked): its free memory plus torch's cached unused blocks are the room; bf16 weights get no
    bfloat16 remedy."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * GIB, 16 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * GIB)
    cuda = torch.device("cuda", 0)
    assert available_bytes(cuda) == (4 * GIB, "free on cuda:0 (16.0 GiB in all)")
    config = AutoConfig.for_model("llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    with pytest.raises(ModelTooLargeError, match=r"'8b' needs 15\.0 GiB for its weights alone in bfloat16, more than "
                                                 r"the 4\.0 GiB free on cuda:0 \(16\.0 GiB in all\); nothing was "
                                                 r"loaded\. Use a smaller model, or a device with more memory\.$"):
        check_weights_fit("8b", config, torch.bfloat16, cuda)
    check_weights_fit("tiny", AutoConfig.from_pretrained(family_dir("llama")), torch.bfloat16, cuda)  # fits
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4, in float32
    with pytest.raises(ModelTooLargeError, match=r"Use bfloat16 weights, 15\.0 GiB \(--dtype bfloat16, or the Tinker "
                                                 r"resource's local_dtype, emulated on this card, which has no bf16 "
                                                 r"tensor cores\), or a smaller model"):
        check_weights_fit("8b", config, torch.float32, cuda)


def test_the_cpus_room_is_memavailable_or_a_containers_headroom_whichever_is_less(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    cpu = torch.device("cpu")
    assert available_bytes(cpu, meminfo, cgroup) == (20000000 * 1024, "available on this machine")  # no cgroup files
    (cgroup / "memory.max").write_text("max\n")
    assert available_bytes(cpu, meminfo, cgroup)[0] == 20000000 * 1024  # no limit
    # an 8 GiB limit, 7 GiB used of which 2 GiB inactive page cache (reclaimed before a kill): 3 GiB of room
    (cgroup / "memory.max").write_text(f"{8 * GIB}\n")
    (cgroup / "memory.current").write_text(f"{7 * GIB}\n")
    (cgroup / "memory.stat").write_text(f"anon {5 * GIB}\nactive_file 0\ninactive_file {2 * GIB}\n")
    assert available_bytes(cpu, meminfo, cgroup) == (3 * GIB, "left under this container's memory limit")
    (cgroup / "memory.max").write_text(f"{64 * GIB}\n")  # a limit above what the machine has: the machine's
    assert available_bytes(cpu, meminfo, cgroup)[1] == "available on this machine"
    meminfo.write_text("garbage\n")
    assert available_bytes(cpu, meminfo, cgroup)[0] == 59 * GIB
    assert available_bytes(cpu, tmp_path / "none", tmp_path / "none") is None
    assert available_bytes(torch.device("meta")) is None


def test_the_devices_whole_memory_is_the_cards_or_memtotal(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    assert model_memory.total_bytes(torch.device("cpu"), meminfo) == 24000000 * 1024
    assert model_memory.total_bytes(torch.device("cpu"), tmp_path / "none") is None
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: type("P", (), {"total_memory": 80 * GIB}))
    assert model_memory.total_bytes(torch.device("cuda", 0)) == 80 * GIB
