"""Reading raw records from a hub dataset id, a local dataset directory, a JSONL file or a parquet file.

Hub ids and directories go through `datasets.load_dataset`, the same call that downloads from the
Hugging Face hub when a network is present. Offline, a hub id resolves to a local mirror directory
`$POSTTRAIN_HUB_MIRROR/<org>/<name>` laid out like the hub repository (same files, same README
`configs:`), so the exact preset code path runs on local data.

JSONL files are read line by line by us rather than by `load_dataset("json")`: Arrow's JSON reader
rejects a whole file for one malformed line or one type mismatch between rows, without saying which
line; reading ourselves lets every error name its line and lets `skip_bad_rows` drop just that line.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.datasets.rows import BadRowError, SkipLog

HUB_MIRROR_ENV = "POSTTRAIN_HUB_MIRROR"
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)


class SourceNotFoundError(FileNotFoundError):
    """The dataset could not be found locally or on the hub; the message says how to provide it."""


@dataclass(frozen=True)
class RawRow:
    """One raw record with its location, used in every error message about it."""

    where: str
    key: str
    record: dict[str, Any]


def is_local_path(source: str) -> bool:
    return source.startswith((".", "/", "~")) or Path(source).expanduser().exists()


def mirror_dir(hub_id: str) -> Path | None:
    """The local mirror of a hub dataset, when $POSTTRAIN_HUB_MIRROR holds one."""
    root = os.environ.get(HUB_MIRROR_ENV)
    if not root:
        return None
    candidate = Path(root).expanduser() / hub_id
    return candidate if candidate.is_dir() else None


def iter_raw_rows(
    source: str,
    *,
    split: str = "train",
    config_name: str | None = None,
    limit: int | None = None,
    skip: SkipLog | None = None,
) -> Iterator[RawRow]:
    """Yield the records of `source` (hub id, directory, .jsonl[.gz] or .parquet file) in order."""
    skip = skip or SkipLog()
    path = Path(source).expanduser()
    if is_local_path(source) and path.is_file():
        if path.name.endswith(JSONL_SUFFIXES):
            yield from _iter_jsonl(path, limit, skip)
            return
        if path.name.endswith(PARQUET_SUFFIXES):
            dataset = _load_uncached("parquet", data_files=str(path), split="train", what=str(path))
            yield from _iter_dataset(dataset, path.name, limit)
            return
        raise SourceNotFoundError(
            f"{path}: unsupported file type; use .jsonl, .jsonl.gz, .json (one object per line) or .parquet"
        )
    if is_local_path(source) and not path.exists():
        raise SourceNotFoundError(f"{path}: no such file or directory")
    location = str(path) if path.is_dir() else (mirror_dir(source) or source)
    label = f"{source}[{split}]"
    if limit is not None:
        # Streaming reads only the first shard(s) needed for `limit` rows instead of the whole dataset.
        stream = _load(str(location), name=config_name, split=split, what=source, streaming=True)
        for index, record in enumerate(_guarded(stream.take(limit), source)):
            yield RawRow(where=f"{label} row {index}", key=str(index), record=record)
        return
    if Path(location).is_dir():
        dataset = _load_uncached(str(location), name=config_name, split=split, what=source)
    else:
        dataset = _load(str(location), name=config_name, split=split, what=source)
    yield from _iter_dataset(dataset, label, limit)


def _load(path: str, *, what: str, **kwargs: Any):
    import datasets

    try:
        return datasets.load_dataset(path, **kwargs)
    except (FileNotFoundError, ConnectionError, OSError) as error:
        raise SourceNotFoundError(
            f"{what}: could not load the dataset ({type(error).__name__}: {error}). Offline, put a copy "
            f"laid out like the hub repository at ${HUB_MIRROR_ENV}/<org>/<name>, or pass a local "
            ".jsonl/.parquet path with a column mapping."
        ) from error
    except ValueError as error:
        raise SourceNotFoundError(f"{what}: {error}") from error


def _load_uncached(path: str, *, what: str, **kwargs: Any):
    """Local copies are read into memory through a throwaway cache: datasets' cache keys local files by
    modification time alone and was seen to serve a stale table after a file was replaced."""
    with tempfile.TemporaryDirectory(prefix="posttrain-datasets-") as cache_dir:
        return _load(path, what=what, cache_dir=cache_dir, keep_in_memory=True, **kwargs)


def _guarded(records: Iterator[dict[str, Any]], what: str) -> Iterator[dict[str, Any]]:
    """Streamed records; a download or read error surfaces with the fix, like a failed load."""
    try:
        yield from records
    except (FileNotFoundError, ConnectionError, OSError) as error:
        raise SourceNotFoundError(
            f"{what}: could not read the dataset ({type(error).__name__}: {error}). Offline, put a copy laid "
            f"out like the hub repository at ${HUB_MIRROR_ENV}/<org>/<name>, or pass a local .jsonl/.parquet path."
        ) from error


def _iter_dataset(dataset, label: str, limit: int | None) -> Iterator[RawRow]:
    count = len(dataset) if limit is None else min(limit, len(dataset))
    for index, record in enumerate(dataset.select(range(count))):
        yield RawRow(where=f"{label} row {index}", key=str(index), record=record)


def _iter_jsonl(path: Path, limit: int | None, skip: SkipLog) -> Iterator[RawRow]:
    opener = gzip.open if path.name.endswith(".gz") else open
    yielded = 0
    with opener(path, "rt", encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if limit is not None and yielded >= limit:
                return
            if not line.strip():
                continue
            where = f"{path} line {line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                skip.reject(BadRowError(where, f"malformed JSON ({error.msg} at column {error.colno})"))
                continue
            if not isinstance(record, dict):
                skip.reject(BadRowError(where, f"expected a JSON object, got {type(record).__name__}"))
                continue
            yielded += 1
            yield RawRow(where=where, key=f"line{line_number}", record=record)
