"""Whether a base model's weights fit where they are to be loaded, checked before a byte of them is read.

Without the check, a model too large for its device fails in the middle of loading: on a GPU as torch's
``OutOfMemoryError`` (an internal error to the client, with the weights loaded so far still held), on the CPU by
the kernel's out-of-memory killer, which takes the whole server down with every other session's adapters and
optimizer state. The weights' size is known from the config alone (the model built on the meta device), and the
device's free memory from the driver or the kernel, so the request that names the model fails instead, saying
how much is needed, how much there is, and what to change. The weights are a lower bound of what serving needs
(activations, caches and optimizer state come on top): a model that passes may still be short of memory later,
where each batch's own error says so (memory_errors.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from localtinker.engine.api import EngineUserError
from localtinker.engine.device import has_native_bf16

logger = logging.getLogger(__name__)

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")  # cgroup v2: a container's own limit, which /proc/meminfo does not show
_GIB = 2**30


class ModelTooLargeError(EngineUserError):
    """A base model's weights need more memory than its device has free; nothing was loaded."""


def weight_bytes(config: Any, dtype: torch.dtype) -> int | None:
    """The bytes of the model's parameters in ``dtype``, each counted once (tied embeddings share one), from its
    config alone: the model is built on the meta device, which allocates nothing. None where the config builds
    no causal LM here (the load then says why)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as error:  # noqa: BLE001 - an estimate only: the real load reports its own failure
        logger.debug("no weight estimate for %s: %s", type(config).__name__, error)
        return None
    return sum(parameter.numel() for parameter in model.parameters()) * dtype.itemsize


def available_bytes(device: torch.device, meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> tuple[int, str] | None:
    """(bytes new allocations may take on ``device``: a model's weights, the sampler's caches; where that is said),
    or None where it cannot be read. On CUDA: the card's free memory plus what torch's cache holds unused. On the
    CPU: the kernel's ``MemAvailable``, or the container's headroom under its cgroup limit where that is less."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached, f"free on {device} ({total / _GIB:.1f} GiB in all)"
    if device.type != "cpu":
        return None
    available = _meminfo_bytes(meminfo, "MemAvailable")
    headroom = _cgroup_headroom(cgroup)
    if headroom is not None and (available is None or headroom < available):
        return headroom, "left under this container's memory limit"
    return (available, "available on this machine") if available is not None else None


def total_bytes(device: torch.device, meminfo: Path = MEMINFO) -> int | None:
    """The device's whole memory: a card's, or the machine's RAM (``MemTotal``); None where it cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return _meminfo_bytes(meminfo, "MemTotal") if device.type == "cpu" else None


def check_weights_fit(name: str, config: Any, dtype: torch.dtype, device: torch.device) -> None:
    """Raises :class:`ModelTooLargeError` where the weights of ``name`` in ``dtype`` need more than ``device`` has
    (see the module docstring); does nothing where either side cannot be known."""
    need = weight_bytes(config, dtype)
    room = available_bytes(device) if need is not None else None
    if need is None or room is None or need <= room[0]:
        return
    have, where = room
    remedies = ["a smaller model", "a device with more memory"]
    if dtype == torch.float32:
        emulated = "" if has_native_bf16(device) else ", emulated on this card, which has no bf16 tensor cores"
        remedies.insert(0, f"bfloat16 weights, {need / 2 / _GIB:.1f} GiB (--dtype bfloat16, or the Tinker resource's "
                           f"local_dtype{emulated})")
    raise ModelTooLargeError(
        f"base model {name!r} needs {need / _GIB:.1f} GiB for its weights alone in {str(dtype).removeprefix('torch.')}, "
        f"more than the {have / _GIB:.1f} GiB {where}; nothing was loaded. Use {', or '.join(remedies)}."
    )


def _meminfo_bytes(meminfo: Path, field: str) -> int | None:
    """``field`` of /proc/meminfo in bytes (the file says kB), or None where it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom(cgroup: Path) -> int | None:
    """The cgroup's (v2; in a container, its own) ``memory.max`` less its working set: ``memory.current`` less the
    inactive page cache, which the kernel reclaims before it kills (how container runtimes count it). None where
    there is no limit to read."""
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit == "max":
            return None
        used = int((cgroup / "memory.current").read_text().strip())
        stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines() if line.count(" ") == 1)
        return max(0, int(limit) - used + int(stat.get("inactive_file", 0)))
    except (OSError, ValueError):
        return None
