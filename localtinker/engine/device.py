"""Which device the engine computes on: ``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``.

``auto`` (the default) takes the first CUDA GPU when torch sees one, else the CPU. The choice comes from the
caller (``serve --device``, the Tinker resource's ``local_device``), else ``$LOCALTINKER_DEVICE``, else ``auto``.
"""

from __future__ import annotations

import os

import torch

ENV_VAR = "LOCALTINKER_DEVICE"
CHOICES_HELP = "auto, cpu, cuda or cuda:N"


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
