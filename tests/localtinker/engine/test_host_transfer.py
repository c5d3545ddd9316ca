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
