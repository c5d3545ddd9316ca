"""The checkpoint log: ``<log_dir>/checkpoints.jsonl``, one JSON object per saved checkpoint.

Every recipe (SFT, DPO, RL, distillation) records its checkpoints here, and resuming reads the last
record back. A record is ``{name, batch, epoch?, final?, state_path?, sampler_path?, ...}``: ``batch``
is the number of optimizer steps (batches) completed when the checkpoint was taken, so training resumes
at batch index ``batch``; ``state_path`` is the ``tinker://.../weights/<name>`` state (LoRA weights +
Adam moments) and ``sampler_path`` the ``tinker://.../sampler_weights/<name>`` weights for sampling.

Crash safety (the training process may be SIGKILLed at any instant):
- a record is appended only after every save it names has returned, so a recorded path always exists;
- each append is one ``write`` of a full line, then ``flush`` + ``fsync``;
- a kill in the middle of an append leaves a torn last line without its newline: readers skip it, and
  the next append first cuts it off so it can never glue onto (and corrupt) the next record;
- a malformed line anywhere *else* is real corruption and raises, naming the file and line.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tinker

from posttrain.atomic_files import staged

CHECKPOINTS_FILE = "checkpoints.jsonl"
_KNOWN_FIELDS = ("name", "batch", "epoch", "final", "state_path", "sampler_path")


class CorruptLogError(ValueError):
    """A JSONL log has a malformed line that is not a torn last line."""


@dataclass(frozen=True)
class CheckpointRecord:
    """One line of ``checkpoints.jsonl``. ``extra`` holds any further keys (metrics, step, run ids)."""

    name: str
    batch: int
    epoch: int | None = None
    final: bool = False
    state_path: str | None = None
    sampler_path: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        record = {key: value for key, value in asdict(self).items() if key != "extra" and value is not None}
        if not self.final:
            record.pop("final")
        clash = set(self.extra) & set(_KNOWN_FIELDS)
        if clash:
            raise ValueError(f"CheckpointRecord.extra must not redefine the fields {sorted(clash)}")
        return {**record, **self.extra}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> CheckpointRecord:
        if "name" not in obj or "batch" not in obj:
            raise ValueError(f"checkpoint record needs 'name' and 'batch', got keys {sorted(obj)}")
        extra = {key: value for key, value in obj.items() if key not in _KNOWN_FIELDS}
        return cls(
            name=str(obj["name"]),
            batch=int(obj["batch"]),
            epoch=None if obj.get("epoch") is None else int(obj["epoch"]),
            final=bool(obj.get("final", False)),
            state_path=obj.get("state_path"),
            sampler_path=obj.get("sampler_path"),
            extra=extra,
        )


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All complete JSON lines of ``path`` ([] when missing), tolerating one torn last line."""
    path = Path(path)
    if not path.exists():
        return []
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    complete, tail = lines[:-1], lines[-1]  # tail is b"" when the file ends with a newline
    records = []
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise CorruptLogError(
                f"{path}:{number}: malformed JSON line ({error.msg}); only a torn *last* line is "
                "expected after a crash: fix or delete this line by hand"
            ) from error
    if tail.strip():
        try:
            records.append(json.loads(tail))  # a complete record that only lacks its newline
        except json.JSONDecodeError:
            pass  # torn by a kill mid-append: that record was never committed
    return records


def append_jsonl(path: str | os.PathLike, obj: dict[str, Any]) -> None:
    """Durably append one JSON line (write + flush + fsync), first cutting off a torn last line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(obj, sort_keys=False, allow_nan=True) + "\n").encode()
    with open(path, "a+b") as handle:
        _cut_torn_tail(handle)
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())


def rewrite_jsonl(path: str | os.PathLike, objs: list[dict[str, Any]]) -> None:
    """Atomically replace ``path`` with ``objs`` (temp file + fsync + rename)."""
    with staged(path) as staging, open(staging, "wb") as handle:
        for obj in objs:
            handle.write((json.dumps(obj) + "\n").encode())
        handle.flush()
        os.fsync(handle.fileno())


def _cut_torn_tail(handle) -> None:
    handle.seek(0, os.SEEK_END)
    size = handle.tell()
    if size == 0:
        return
    handle.seek(size - 1)
    if handle.read(1) == b"\n":
        return
    # Find the end of the last complete line; a JSON-complete tail just lacks its newline.
    handle.seek(0)
    data = handle.read()
    last_newline = data.rfind(b"\n")
    tail = data[last_newline + 1 :]
    try:
        json.loads(tail)
        handle.write(b"\n")
    except json.JSONDecodeError:
        handle.truncate(last_newline + 1)
        handle.seek(0, os.SEEK_END)


def checkpoints_path(log_dir: str | os.PathLike) -> Path:
    return Path(log_dir) / CHECKPOINTS_FILE


def read_checkpoints(log_dir: str | os.PathLike) -> list[CheckpointRecord]:
    """Every committed checkpoint record in ``log_dir``, oldest first."""
    path = checkpoints_path(log_dir)
    records = []
    for number, obj in enumerate(read_jsonl(path), start=1):
        try:
            records.append(CheckpointRecord.from_json(obj))
        except (ValueError, TypeError) as error:
            raise CorruptLogError(f"{path}: record {number}: {error}") from error
    return records


def append_checkpoint(log_dir: str | os.PathLike, record: CheckpointRecord) -> None:
    """Durably commit ``record``. Call only after every save it names has returned."""
    append_jsonl(checkpoints_path(log_dir), record.to_json())


def last_checkpoint(log_dir: str | os.PathLike, required_key: str = "state_path") -> CheckpointRecord | None:
    """The newest record that has ``required_key`` set (``state_path`` to resume training), or None."""
    for record in reversed(read_checkpoints(log_dir)):
        if getattr(record, required_key, None) or record.extra.get(required_key):
            return record
    return None


def save_checkpoint(
    training_client: tinker.TrainingClient,
    log_dir: str | os.PathLike,
    *,
    name: str,
    batch: int,
    epoch: int | None = None,
    final: bool = False,
    kind: str = "both",
    extra: dict[str, Any] | None = None,
    ttl_seconds: int | None = None,
    commit: bool = True,
) -> CheckpointRecord:
    """Save state and/or sampler weights, wait for both, then commit the record to the log.

    ``commit=False`` returns the record without appending it, for callers that must do something
    (flush metrics) between "saved" and "recorded"; they then call :func:`append_checkpoint`.

    ``kind``: "state" (resumable: weights + optimizer), "sampler" (for sampling/eval) or "both".
    Both saves are submitted before either is awaited; they run after every op already submitted on
    ``training_client``, so they capture exactly the weights after ``batch`` optimizer steps.
    """
    if kind not in ("state", "sampler", "both"):
        raise ValueError(f"save_checkpoint kind must be 'state', 'sampler' or 'both', got {kind!r}")
    state_future = training_client.save_state(name, ttl_seconds=ttl_seconds) if kind != "sampler" else None
    sampler_future = (
        training_client.save_weights_for_sampler(name, ttl_seconds=ttl_seconds) if kind != "state" else None
    )
    record = CheckpointRecord(
        name=name,
        batch=batch,
        epoch=epoch,
        final=final,
        state_path=state_future.result().path if state_future else None,
        sampler_path=sampler_future.result().path if sampler_future else None,
        extra=dict(extra or {}),
    )
    if commit:
        append_checkpoint(log_dir, record)
    return record
