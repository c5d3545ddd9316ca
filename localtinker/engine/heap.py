"""Keep freed memory in the process heap, so each training step does not page-fault its buffers in anew.

glibc's malloc serves every block above its mmap threshold (at most 32 MB) with a fresh ``mmap`` and
hands it back to the kernel on ``free``; in a thread other than the main one, any block larger than
the thread's 64 MB heap takes the same path whatever the threshold. The engine allocates several
[tokens × vocab] float32 buffers per micro-batch (100 MB each for 512 tokens × SmolLM2's 49152), so
every SFT step touched ~800 MB of brand-new pages. On a virtual machine a first touch also faults on
the host, which cost a visible share of a step in system time (docs/engine-notes.md, heap); with the settings below
a step page-faults nothing from the second step on.

What it sets, process-wide (it is an allocator policy, so it cannot be scoped to the engine):

- ``M_MMAP_THRESHOLD`` = 1 GiB: blocks up to that come from the heap, and are reused once freed;
- ``M_TRIM_THRESHOLD`` = 1 GiB: free memory at the heap's top is kept, not returned to the kernel;
- ``M_ARENA_MAX`` = 1: threads allocate from the main heap, because only the main heap grows past
  64 MB (the engine runs on the protocol's worker thread).

Cost: the process keeps its peak heap (the RSS no longer shrinks after a big step); the peak itself
does not change. ``LOCALTINKER_KEEP_FREED_MEMORY=0`` turns it off; elsewhere than Linux with glibc it
does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

logger = logging.getLogger("localtinker")

ENV_SWITCH = "LOCALTINKER_KEEP_FREED_MEMORY"

# mallopt parameter numbers from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

KEPT_BLOCK_BYTES = 1 << 30

_settings = {
    "M_MMAP_THRESHOLD": (M_MMAP_THRESHOLD, KEPT_BLOCK_BYTES),
    "M_TRIM_THRESHOLD": (M_TRIM_THRESHOLD, KEPT_BLOCK_BYTES),
    "M_ARENA_MAX": (M_ARENA_MAX, 1),
}
_applied: dict[str, bool] | None = None


def keep_freed_memory() -> dict[str, bool]:
    """Applies the settings above once per process; returns which of them glibc accepted (empty when
    switched off or not on glibc). Safe to call again: later calls return the first result."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = {}
    if os.environ.get(ENV_SWITCH, "1") == "0":
        logger.debug("%s=0: glibc malloc keeps its defaults", ENV_SWITCH)
        return _applied
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return _applied
    for name, (parameter, value) in _settings.items():
        _applied[name] = bool(mallopt(parameter, value))
    refused = [name for name, accepted in _applied.items() if not accepted]
    if refused:
        logger.warning("glibc refused mallopt %s; big buffers may be page-faulted in on every step", refused)
    return _applied


def _glibc_mallopt():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt
