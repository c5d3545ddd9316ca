"""``dg.Output`` with a data version: the one place that passes Dagster's beta ``data_version`` parameter."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, TypeVar

import dagster as dg

T = TypeVar("T")


def versioned_output(value: T, metadata: Mapping[str, Any], data_version: str) -> dg.Output[T]:
    """An output whose data version is ``data_version``. Exact lineage keys every table by its data version, but
    ``Output(data_version=)`` is beta in Dagster 1.13 and warns on every call; nothing else sets a version on an
    output, so the warning is silenced here (and only for this call) instead of printed between `make demo`'s tables."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.BetaWarning)
        return dg.Output(value, metadata=dict(metadata), data_version=dg.DataVersion(data_version))
