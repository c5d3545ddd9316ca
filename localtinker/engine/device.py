"""Which device the engine computes on: ``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``.

``auto`` (the default) takes the first CUDA GPU when torch sees one, else the CPU. The choice comes from the
caller (``serve --device``, the Tinker resource's ``local_device``), else ``$LOCALTINKER_DEVICE``, else ``auto``.

What a CUDA card can run depends on its compute capability, and the GPUs people have span several generations
(a Colab T4 is sm75, a V100 sm70, a GTX 1080 sm61). Every CUDA-path choice that depends on the card asks here:

- **native bf16** from sm80 (A100, A10, L4, RTX 30xx and newer): the default dtype there is bfloat16; older
  cards have no bf16 tensor cores, so their default is float32 (float16 is not offered: training in it needs
  loss scaling, and bf16-trained models overflow its range);
- **torch's flash kernels** (packed rows by their bounds) from sm80: older cards run packed rows as one sdpa
  call per row, the same function;
- **Triton** (the compiled pieces) from sm70: older cards run the pieces op by op.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType

import torch

ENV_VAR = "LOCALTINKER_DEVICE"
CHOICES_HELP = "auto, cpu, cuda or cuda:N"
NATIVE_BF16 = (8, 0)  # bf16 tensor cores (Ampere)
FLASH_KERNELS = (8, 0)  # torch's FlashAttention-2 kernels, varlen included
TRITON_KERNELS = (7, 0)  # what Triton, and so torch.compile's GPU code, runs on


def device_setting(requested: str | None = None) -> str:
    """The device string in force: ``requested`` when given, else ``$LOCALTINKER_DEVICE``, else ``auto``."""
    return (requested or os.environ.get(ENV_VAR) or "auto").strip().lower()


def resolve_device(requested: str | None = None) -> torch.device:
    """The torch device for ``requested`` (see :func:`device_setting`); a clear error for what cannot run here."""
    setting = device_setting(requested)
    if setting == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if setting == "cpu":
        return torch.device("cpu")
    kind, _, index = setting.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"device {setting!r} is not one of {CHOICES_HELP} (from --device or ${ENV_VAR}).")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {setting!r} asked for, but this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu, "
            "or install a CUDA build of torch (README: GPU install)."
        )
    number = int(index or 0)
    if number >= torch.cuda.device_count():
        raise ValueError(f"device {setting!r}: this machine has {torch.cuda.device_count()} CUDA device(s).")
    return torch.device("cuda", number)


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """The card's compute capability (major, minor); None off CUDA."""
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def has_native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes in bf16 natively: the CPU (where bf16_matmul.py decides whether to use it), or a
    CUDA card from sm80."""
    capability = cuda_capability(device)
    return capability is None or capability >= NATIVE_BF16


def runs_flash_kernels(device: torch.device) -> bool:
    """Whether torch's flash attention kernels run on ``device``: a CUDA card from sm80."""
    capability = cuda_capability(device)
    return capability is not None and capability >= FLASH_KERNELS


def runs_triton(device: torch.device) -> bool:
    """Whether Triton kernels (torch.compile's GPU code) run on ``device``: a CUDA card from sm70."""
    capability = cuda_capability(device)
    return capability is not None and capability >= TRITON_KERNELS


def default_dtype(device: torch.device) -> str:
    """The weights' dtype for ``--dtype auto``: bfloat16 on a CUDA card with native bf16, else float32 (the CPU's
    exact default, and older cards', which would emulate bf16)."""
    return "bfloat16" if device.type == "cuda" and has_native_bf16(device) else "float32"


def card_summary(device: torch.device) -> str:
    """One line on what ``device`` runs, for the server's start-up log (empty off CUDA)."""
    capability = cuda_capability(device)
    if capability is None:
        return ""
    missing = [what for what, runs in (("bf16", has_native_bf16(device)), ("flash kernels", runs_flash_kernels(device)),
                                       ("Triton", runs_triton(device))) if not runs]
    name = torch.cuda.get_device_name(device)
    return f"{name}, sm{capability[0]}{capability[1]}" + (f", without {', '.join(missing)}" if missing else "")


def describe_device(device: torch.device) -> str:
    """``device`` for people: ``cpu``, or ``cuda:0 = <card>, sm75, without bf16, flash kernels`` (the server's
    start-up line, a run's metadata)."""
    card = card_summary(device)
    return f"{device} = {card}" if card else str(device)


def dtype_warning(device: torch.device, dtype: str) -> str | None:
    """Why ``dtype`` on ``device`` is a poor choice, or None: bfloat16 on a CUDA card without native bf16."""
    if dtype == "bfloat16" and device.type == "cuda" and not has_native_bf16(device):
        major, minor = cuda_capability(device)
        return (f"dtype bfloat16 on a card of compute capability {major}.{minor}, which has no bf16 tensor cores (they "
                "start at 8.0): bf16 runs emulated there, and some kernels refuse it; --dtype float32, this card's "
                "default, is the safe choice")
    return None


@contextmanager
def device_scope(device: torch.device) -> Iterator[None]:
    """Within the block, ``device`` is the thread's current CUDA device (a no-op off CUDA). CUDA's current device
    is per thread, and each new thread starts on card 0: the protocol's worker thread, a caller's own. What takes
    the current device rather than its tensors' — a CUDA graph's capture stream, an event's ``record()``, a new
    stream — would otherwise go to card 0 while an engine on ``cuda:1`` computes on card 1: a decode graph
    capturing nothing of its step, a wait on sampled tokens returning before they are copied."""
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.current_device()
    torch.cuda.set_device(device)
    try:
        yield
    finally:
        torch.cuda.set_device(previous)


class DeviceLock:
    """The engine's re-entrant lock; holding it also holds :func:`device_scope` of the engine's device, so every
    engine call computes with its card current, from whichever thread it comes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._lock = threading.RLock()
        self._scopes: list[AbstractContextManager] = []  # one per nested entry (only the holder enters)

    def __enter__(self) -> DeviceLock:
        self._lock.acquire()
        scope = device_scope(self.device)
        try:
            scope.__enter__()
        except BaseException:
            self._lock.release()
            raise
        self._scopes.append(scope)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self._scopes.pop().__exit__(exc_type, exc, tb)
        finally:
            self._lock.release()
