"""Running out of device memory, told as what the request can change.

torch's ``OutOfMemoryError`` names an allocation ("Tried to allocate 2.00 GiB ..."), which reached clients as an
internal server error. The same request fails the same way on the same card, so it is the client's to change:
the engine answers it as an :class:`EngineUserError` that says what ran out, that nothing was changed, and what
to send instead, and hands the freed blocks back to the device so the next request starts from a clean cache.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from localtinker.engine.api import EngineUserError

logger = logging.getLogger(__name__)


class DeviceMemoryError(EngineUserError):
    """A request needed more memory than the device had free; the engine's state is as before it."""


# What a sampling request can change when its batch ran out of memory.
SAMPLING_REMEDY = "Sample fewer sequences at once (num_samples, or fewer requests in flight) or fewer max_tokens."


def device_memory_error(error: BaseException, work: str, device: torch.device, remedy: str) -> BaseException:
    """``error`` as a :class:`DeviceMemoryError` naming ``work``, the device's free and total memory and
    ``remedy`` when it is torch's ``OutOfMemoryError`` (logged for the operator: a user error is otherwise not);
    any other error unchanged. Only for work whose failure leaves no state changed."""
    if not isinstance(error, torch.OutOfMemoryError):
        return error
    detail = str(error).splitlines()[0] if str(error) else "out of memory"
    message = f"{work} ran out of {device} memory{_memory_state(device)}; nothing was changed. {remedy} (torch: {detail})"
    logger.warning("%s", message)
    return DeviceMemoryError(message)


@contextmanager
def memory_errors_named(work: str, device: torch.device, remedy: str) -> Iterator[None]:
    """Raises an ``OutOfMemoryError`` from inside as :func:`device_memory_error`'s :class:`DeviceMemoryError`."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        raise device_memory_error(error, work, device, remedy) from None


def _memory_state(device: torch.device) -> str:
    """`` (x GiB free of y GiB)`` on a CUDA device, after handing its cached free blocks back; empty elsewhere."""
    if device.type != "cuda":
        return ""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return f" ({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB once the cache was emptied)"
