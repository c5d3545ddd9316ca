"""One-copy transfers of many tensors (host_transfer.py): the one-copy path is forced on the CPU here; the CUDA
test in test_cuda.py runs it where it is the default."""

from __future__ import annotations

import torch

from localtinker.engine.host_transfer import copy_into, to_host


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "a.lora_A": torch.randn(4, 8, generator=generator),
        "a.lora_B": torch.randn(8, 4, generator=generator),
        "steps": torch.arange(3),  # another dtype: its own buffer
        "b.lora_A": torch.randn(2, 8, generator=generator),
    }


def test_one_copy_to_host_hands_back_equal_views_of_one_buffer_per_dtype():
    tensors = _tensors()
    copies = to_host(tensors, one_copy=True)
    assert list(copies) == list(tensors)
    for key, tensor in tensors.items():
        assert torch.equal(copies[key], tensor) and copies[key].dtype == tensor.dtype
        assert copies[key].data_ptr() != tensor.data_ptr()  # a copy, not the training tensor
    floats = {copies[key].untyped_storage().data_ptr() for key in ("a.lora_A", "a.lora_B", "b.lora_A")}
    assert len(floats) == 1 and copies["steps"].untyped_storage().data_ptr() not in floats
    tensors["a.lora_A"].add_(1.0)  # training goes on; the snapshot does not move
    assert not torch.equal(copies["a.lora_A"], tensors["a.lora_A"])


def test_plain_to_host_copies_each_tensor():
    copies = to_host(_tensors())
    assert len({copy.untyped_storage().data_ptr() for copy in copies.values()}) == 4


def test_copy_into_takes_one_buffer_as_it_lies_or_gathers_scattered_sources():
    tensors = _tensors()
    laid_out = to_host(tensors, one_copy=True)
    scattered = {key: value.t().contiguous().t() if value.dim() == 2 else value.clone() for key, value in tensors.items()}
    assert not scattered["a.lora_A"].is_contiguous()
    for sources in (laid_out, scattered):
        targets = {key: torch.zeros_like(value) for key, value in tensors.items()}
        copy_into(targets, sources, one_copy=True)
        for key, value in tensors.items():
            assert torch.equal(targets[key], value)


def test_copy_into_does_not_read_a_buffer_out_of_order_as_laid_out():
    """Views of one buffer listed in another order than they lie in it are gathered, not read as one run."""
    tensors = _tensors()
    laid_out = to_host(tensors, one_copy=True)
    reordered = {key: laid_out[key] for key in reversed(list(laid_out))}
    targets = {key: torch.zeros_like(laid_out[key]) for key in reordered}
    copy_into(targets, reordered, one_copy=True)
    for key, value in tensors.items():
        assert torch.equal(targets[key], value)


def test_a_host_that_cannot_lock_memory_gets_pageable_copies_and_a_warning(monkeypatch, caplog):
    """Page-locking can fail (here: no CUDA, so no pinned allocator); the transfer goes on through pageable memory."""
    import localtinker.engine.host_transfer as host_transfer

    monkeypatch.setattr(host_transfer, "_pinnable", lambda: True)
    tensors = _tensors()
    with caplog.at_level("WARNING", logger="localtinker.engine"):
        copies = to_host(tensors, one_copy=True)
        targets = {key: torch.zeros_like(value) for key, value in tensors.items()}
        copy_into(targets, {key: value.clone() for key, value in copies.items()}, one_copy=True)
    assert all(torch.equal(copies[key], value) and torch.equal(targets[key], value) for key, value in tensors.items())
    assert "no page-locked memory" in caplog.text


def test_views_of_one_buffer_go_to_checkpoint_files_as_separate_tensors(tmp_path):
    """Checkpoints (safetensors) and spilled snapshots (torch.save) take the views as they are."""
    from safetensors.torch import load_file, save_file

    tensors = _tensors()
    copies = to_host(tensors, one_copy=True)
    save_file(copies, str(tmp_path / "adapter.safetensors"))
    torch.save(copies, tmp_path / "snapshot.pt")
    for loaded in (load_file(str(tmp_path / "adapter.safetensors")), torch.load(tmp_path / "snapshot.pt")):
        assert all(torch.equal(loaded[key], value) for key, value in tensors.items())
    assert (tmp_path / "adapter.safetensors").stat().st_size < 2 * sum(t.nbytes for t in tensors.values())


def test_to_device_on_the_cpu_hands_back_the_tensors_themselves():
    from localtinker.engine.host_transfer import to_device

    tensors = _tensors()
    moved = to_device(tensors, torch.device("cpu"))
    assert all(moved[key] is value for key, value in tensors.items())
