"""A model's many small tensors between a CUDA device and the host, one copy each way.

An RL step snapshots the training adapter to the host and the sampler copies it back: on a 1B model that is
224 LoRA tensors, and one copy per tensor to or from pageable memory cost ~0.1 s of host time each way (a GRPO
step's profile on an H200, docs/localtinker-gpu.md) for ~2 ms of transfers; a checkpoint adds the 448 Adam
moments. Here tensors of one dtype are laid end to end on the device and cross in one copy to or from pinned
host memory, which the host hands back as views. On the CPU nothing changes: each tensor is copied as before.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch

logger = logging.getLogger("localtinker.engine")


def to_host(tensors: dict[str, torch.Tensor], one_copy: bool | None = None) -> dict[str, torch.Tensor]:
    """Host copies of ``tensors`` (detached). From a CUDA device (or with ``one_copy``, which the CPU tests use)
    they are views of one buffer per dtype, pinned where CUDA is, filled by one copy. The views do not overlap,
    so ``torch.save`` and safetensors both write them as separate tensors."""
    if one_copy is None:
        one_copy = any(tensor.device.type == "cuda" for tensor in tensors.values())
    if not tensors or not one_copy:
        return {key: tensor.detach().to("cpu", copy=True) for key, tensor in tensors.items()}
    copies: dict[str, torch.Tensor] = {}
    for group in _by_dtype(tensors).values():
        flat = torch.cat([tensors[key].detach().reshape(-1) for key in group])
        host = _host_buffer(flat.numel(), flat.dtype)
        host.copy_(flat)
        copies.update(_views(host, {key: tensors[key].shape for key in group}))
    return {key: copies[key] for key in tensors}


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``tensors`` on ``device``: new tensors filled as :func:`copy_into` fills them (one copy per dtype from the
    host to a CUDA device); on the CPU, ``tensor.to(device)`` (no copy of a tensor already there)."""
    if device.type != "cuda":
        return {key: tensor.to(device) for key, tensor in tensors.items()}
    targets = {key: torch.empty(tensor.shape, dtype=tensor.dtype, device=device) for key, tensor in tensors.items()}
    copy_into(targets, tensors)
    return targets


def copy_into(targets: dict[str, torch.Tensor], sources: dict[str, torch.Tensor], one_copy: bool | None = None) -> None:
    """``targets[key].copy_(sources[key])`` for every key of ``targets`` (same shapes, checked by the caller).
    Host sources for CUDA targets (or any, with ``one_copy``) cross as one buffer per dtype (the sources' own
    storage when they already lie end to end in it, as :func:`to_host` leaves them) and land with one
    multi-tensor copy."""
    keys = list(targets)
    if one_copy is None:
        one_copy = bool(keys) and all(targets[key].device.type == "cuda" for key in keys)
    if not one_copy or not all(sources[key].device.type == "cpu" for key in keys):
        with torch.no_grad():
            for key in keys:
                targets[key].copy_(sources[key])
        return
    device = targets[keys[0]].device
    for group in _by_dtype({key: sources[key] for key in keys}).values():
        buffer = _end_to_end(group, sources)
        if buffer is None:
            buffer = _host_buffer(sum(sources[key].numel() for key in group), sources[group[0]].dtype)
            torch.cat([sources[key].reshape(-1) for key in group], out=buffer)
        on_device = buffer.to(device, non_blocking=buffer.is_pinned())
        views = _views(on_device, {key: sources[key].shape for key in group})
        with torch.no_grad():
            torch._foreach_copy_([targets[key] for key in group], [views[key] for key in group])


def _pinnable() -> bool:
    """Page-locked host memory (what lets a copy run at the bus's speed) exists only beside a CUDA device."""
    return torch.cuda.is_available()


def _host_buffer(count: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty host buffer, page-locked where it can be: a host that cannot lock more memory gets pageable
    memory (the copy is slower, the request still succeeds), and a warning."""
    if _pinnable():
        try:
            return torch.empty(count, dtype=dtype, pin_memory=True)
        except RuntimeError as error:
            logger.warning("host_transfer: no page-locked memory for %d bytes (%s); copying through pageable memory",
                           count * dtype.itemsize, str(error).splitlines()[0])
    return torch.empty(count, dtype=dtype)


def _by_dtype(tensors: dict[str, torch.Tensor]) -> dict[torch.dtype, list[str]]:
    groups: dict[torch.dtype, list[str]] = defaultdict(list)
    for key, tensor in tensors.items():
        groups[tensor.dtype].append(key)
    return groups


def _views(flat: torch.Tensor, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    views, offset = {}, 0
    for key, shape in shapes.items():
        count = shape.numel()
        views[key] = flat[offset : offset + count].view(shape)
        offset += count
    return views


def _end_to_end(group: list[str], sources: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """One flat view over ``group``'s sources when they are contiguous and follow each other in one storage, in
    ``group``'s order; None otherwise."""
    first = sources[group[0]]
    storage = first.untyped_storage()
    offset = first.storage_offset()
    for key in group:
        tensor = sources[key]
        if (not tensor.is_contiguous() or tensor.untyped_storage().data_ptr() != storage.data_ptr()
                or tensor.storage_offset() != offset):
            return None
        offset += tensor.numel()
    total = offset - first.storage_offset()
    return first.new_empty(0).set_(storage, first.storage_offset(), (total,))
