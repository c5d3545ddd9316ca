"""Where training metrics go: a tiny protocol and the loggers this library ships.

Trainers depend only on :class:`MetricsLogger`; the Dagster layer adds an MLflow implementation in
``resources/`` against the same protocol, so ``posttrain`` never imports MLflow.

Exactly-once after a crash: the supervised trainer hands metrics to its loggers only when they are
*committed*, right before the checkpoint covering those steps is recorded, so a SIGKILL never leaves
metrics of steps the resumed run will redo, except for a kill between that flush and the record. For
that case a logger may implement ``truncate_from(step)`` (optional, not in the protocol): the trainer
calls it when resuming at ``step``. :class:`JsonlMetricsLogger` implements it, so its file holds every
step exactly once whatever the moment of the kill.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO, runtime_checkable

from posttrain.checkpoints import append_jsonl, read_jsonl, rewrite_jsonl

METRICS_FILE = "metrics.jsonl"


@runtime_checkable
class MetricsLogger(Protocol):
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_params(self, params: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlMetricsLogger:
    """Appends ``{"step": step, **metrics}`` lines (fsynced) to a JSONL file; params to ``params.json``-like lines.

    Lines written before a resume at step ``s`` with ``step >= s`` are removed by ``truncate_from(s)``.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        append_jsonl(self.path, {"step": int(step), **{key: _plain(value) for key, value in metrics.items()}})

    def log_params(self, params: dict[str, Any]) -> None:
        append_jsonl(self.path.with_name(self.path.stem + ".params.jsonl"), {"params": params})

    def truncate_from(self, step: int) -> None:
        """Forget every metrics line with ``step >= step`` (called when resuming at ``step``)."""
        kept = [row for row in read_jsonl(self.path) if int(row.get("step", -1)) < step]
        if self.path.exists():
            rewrite_jsonl(self.path, kept)

    def close(self) -> None:
        pass


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows a :class:`JsonlMetricsLogger` wrote, in order."""
    return read_jsonl(path)


class ConsoleMetricsLogger:
    """One short line per logged step on a stream (stderr by default), throttled to ``every_seconds``."""

    def __init__(self, stream: TextIO | None = None, every_seconds: float = 0.0, keys: tuple[str, ...] = ()):
        self.stream = stream or sys.stderr
        self.every_seconds = every_seconds
        self.keys = keys
        self._last = -math.inf

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = time.monotonic()
        shown = {key: metrics[key] for key in (self.keys or tuple(metrics)) if key in metrics}
        if not shown or now - self._last < self.every_seconds:
            return
        self._last = now
        text = " ".join(f"{key}={_short(value)}" for key, value in shown.items())
        print(f"step {step}: {text}", file=self.stream, flush=True)

    def log_params(self, params: dict[str, Any]) -> None:
        print("params: " + ", ".join(f"{key}={value}" for key, value in params.items()), file=self.stream)

    def close(self) -> None:
        pass


class MultiLogger:
    """Fans every call out to several loggers (in order)."""

    def __init__(self, loggers: list[MetricsLogger] | tuple[MetricsLogger, ...]):
        self.loggers = list(loggers)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log_metrics(metrics, step)

    def log_params(self, params: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.log_params(params)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
