"""Reading raw records from a hub dataset id, a local dataset directory, a JSONL file or a parquet file,
and saying exactly which version was read.

Hub ids go through `datasets.load_dataset`, the call that downloads from the Hugging Face hub when a
network is present, at a resolved commit: online, the requested revision (default: the main branch) is
resolved to its commit sha first and that sha is loaded and recorded; offline (HF_HUB_OFFLINE /
HF_DATASETS_OFFLINE), only what the local `datasets` cache holds can be read, and the commit recorded
is the one the cache was built from. A hub id may also resolve to a local mirror directory
`$POSTTRAIN_HUB_MIRROR/<org>/<name>` laid out like the hub repository (same files, same README
`configs:`), so the exact preset code path runs on local data. Local files, directories and mirrors
are versioned by a sha256 digest of their bytes.

JSONL files are read line by line by us rather than by `load_dataset("json")`: Arrow's JSON reader
rejects a whole file for one malformed line or one type mismatch between rows, without saying which
line; reading ourselves lets every error name its line and lets `skip_bad_rows` drop just that line.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.datasets.rows import BadRowError, SkipLog

HUB_MIRROR_ENV = "POSTTRAIN_HUB_MIRROR"
OFFLINE_ENVS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
SAVE_TO_DISK_MARKERS = ("dataset_dict.json", "state.json")
COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")


class SourceNotFoundError(FileNotFoundError):
    """The dataset could not be found locally or on the hub; the message says how to provide it."""


class OfflineSourceError(SourceNotFoundError):
    """A hub dataset is neither cached nor mirrored and offline mode forbids downloading it."""


@dataclass(frozen=True)
class RawRow:
    """One raw record with its location, used in every error message about it."""

    where: str
    key: str
    record: dict[str, Any]


@dataclass(frozen=True)
class SourceRead:
    """The records of one source and the exact version they come from.

    `kind` is "hub" (read through the hub or its local cache), "mirror" ($POSTTRAIN_HUB_MIRROR), or
    "local" (a file or directory); `revision` is the hub commit sha, or "sha256:<hex>" of the local bytes.
    """

    rows: Iterator[RawRow]
    kind: str
    location: str
    revision: str


def is_local_path(source: str) -> bool:
    """A path (existing, explicit, or named like a data file), not a hub id: a missing `data/x.jsonl` is a
    missing file, not a dataset to look for on the hub."""
    return source.startswith((".", "/", "~")) or source.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES) or Path(source).expanduser().exists()


def hub_offline() -> bool:
    """Whether the environment forbids hub downloads (read at call time, as the user set it)."""
    return any(os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"} for name in OFFLINE_ENVS)


def mirror_dir(hub_id: str) -> Path | None:
    """The local mirror of a hub dataset, when $POSTTRAIN_HUB_MIRROR holds one."""
    root = os.environ.get(HUB_MIRROR_ENV)
    if not root:
        return None
    candidate = Path(root).expanduser() / hub_id
    return candidate if candidate.is_dir() else None


def read_source(
    source: str,
    *,
    split: str = "train",
    config_name: str | None = None,
    revision: str | None = None,
    limit: int | None = None,
    skip: SkipLog | None = None,
) -> SourceRead:
    """Open `source` (hub id, directory, .jsonl[.gz] or .parquet file) and resolve its version; the
    rows are yielded in source order, at most `limit` of them (None: the whole split)."""
    skip = skip or SkipLog()
    path = Path(source).expanduser()
    if is_local_path(source):
        if not path.exists():
            raise SourceNotFoundError(f"{path}: no such file or directory")
        return SourceRead(_local_rows(path, split, config_name, limit, skip), "local", str(path), local_digest(path))
    mirror = mirror_dir(source)
    if mirror is not None:
        label = f"{source}[{split}]"
        return SourceRead(_directory_rows(mirror, label, split, config_name, limit), "mirror", str(mirror), local_digest(mirror))
    return _hub_read(source, split, config_name, revision, limit)


def iter_raw_rows(source: str, **kwargs: Any) -> Iterator[RawRow]:
    """The rows of `read_source` alone, for callers that do not record the version."""
    return read_source(source, **kwargs).rows


def local_digest(path: Path) -> str:
    """sha256 of a file's bytes (what `sha256sum` prints), or of a directory's files (relative names and
    contents, sorted; hidden files excluded): it changes exactly when the data a user points at changes."""
    digest = hashlib.sha256()
    if path.is_file():
        _hash_file(path, digest)
        return f"sha256:{digest.hexdigest()}"
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        relative = file.relative_to(path)
        if any(part.startswith(".") for part in relative.parts):
            continue
        digest.update(f"{relative.as_posix()}\0".encode())
        _hash_file(file, digest)
    return f"sha256:{digest.hexdigest()}"


def _hash_file(path: Path, digest) -> None:
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)


def _local_rows(path: Path, split: str, config_name: str | None, limit: int | None, skip: SkipLog) -> Iterator[RawRow]:
    if path.is_dir():
        if any((path / marker).exists() for marker in SAVE_TO_DISK_MARKERS):
            return _saved_rows(path, split, limit)
        return _directory_rows(path, f"{path}[{split}]", split, config_name, limit)
    if path.name.endswith(JSONL_SUFFIXES):
        return _iter_jsonl(path, limit, skip)
    if path.name.endswith(PARQUET_SUFFIXES):
        dataset = _load_uncached("parquet", data_files=str(path), split="train", what=str(path))
        return _iter_dataset(dataset, path.name, limit)
    raise SourceNotFoundError(
        f"{path}: unsupported file type; use .jsonl, .jsonl.gz, .json (one object per line), .parquet, "
        "or a directory written by datasets' save_to_disk"
    )


def _directory_rows(path: Path, label: str, split: str, config_name: str | None, limit: int | None) -> Iterator[RawRow]:
    dataset = _load_uncached(str(path), name=config_name, split=split, what=label)
    return _iter_dataset(dataset, label, limit)


def _saved_rows(path: Path, split: str, limit: int | None) -> Iterator[RawRow]:
    """A directory written by `Dataset.save_to_disk` (one table) or `DatasetDict.save_to_disk` (one per split)."""
    import datasets

    try:
        saved = datasets.load_from_disk(str(path), keep_in_memory=True)
    except (FileNotFoundError, OSError, ValueError) as error:
        raise SourceNotFoundError(f"{path}: not a readable save_to_disk directory ({error})") from error
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise SourceNotFoundError(f"{path}: no split {split!r}; this save_to_disk directory has {sorted(saved)}")
        return _iter_dataset(saved[split], f"{path}[{split}]", limit)
    return _iter_dataset(saved, str(path), limit)


def _hub_read(hub_id: str, split: str, config_name: str | None, revision: str | None, limit: int | None) -> SourceRead:
    label = f"{hub_id}[{split}]"
    if hub_offline():
        dataset = _load(hub_id, name=config_name, split=split, revision=revision, what=hub_id, offline=True)
        cached = _cached_commit(dataset)
        if revision and cached and revision != cached and COMMIT_SHA.match(revision):
            raise OfflineSourceError(
                f"{hub_id}: the local datasets cache holds commit {cached}, not the requested revision {revision}, "
                f"and offline mode ({' / '.join(OFFLINE_ENVS)}) forbids downloading it. {_fixes(hub_id)}"
            )
        resolved = cached or f"unknown (offline cache; requested {revision or 'main'})"
        return SourceRead(_iter_dataset(dataset, label, limit), "hub", hub_id, resolved)
    commit = _hub_commit(hub_id, revision)
    if limit is not None:
        # Streaming reads only the first shard(s) needed for `limit` rows instead of the whole dataset.
        stream = _load(hub_id, name=config_name, split=split, revision=commit, what=hub_id, streaming=True)
        rows = (RawRow(f"{label} row {i}", str(i), record) for i, record in enumerate(_guarded(stream.take(limit), hub_id)))
        return SourceRead(rows, "hub", hub_id, commit)
    dataset = _load(hub_id, name=config_name, split=split, revision=commit, what=hub_id)
    return SourceRead(_iter_dataset(dataset, label, limit), "hub", hub_id, commit)


def _hub_commit(hub_id: str, revision: str | None) -> str:
    """The commit sha a branch, tag or sha names on the hub (one API call), so the recorded version is
    the one loaded even if the branch moves meanwhile."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return HfApi().dataset_info(hub_id, revision=revision).sha
    except RevisionNotFoundError as error:
        raise SourceNotFoundError(f"{hub_id}: the hub has no revision {revision!r} (a branch, tag or commit sha)") from error
    except RepositoryNotFoundError as error:
        raise SourceNotFoundError(
            f"{hub_id}: no such dataset on the hub (or it is private/gated: set HF_TOKEN). {_fixes(hub_id)}"
        ) from error
    except (HfHubHTTPError, ConnectionError, OSError) as error:
        raise SourceNotFoundError(f"{hub_id}: could not reach the hub ({type(error).__name__}: {error}). {_fixes(hub_id)}") from error


def _cached_commit(dataset) -> str | None:
    """The hub commit a cached dataset was built from: `datasets` names its cache directory
    `<org>___<name>/<config>/<version>/<commit sha>`."""
    for cache_file in getattr(dataset, "cache_files", None) or []:
        for part in reversed(Path(cache_file.get("filename", "")).parts):
            if COMMIT_SHA.match(part):
                return part
    return None


def _fixes(hub_id: str) -> str:
    return (
        "Either go online (unset HF_HUB_OFFLINE and HF_DATASETS_OFFLINE) so it is downloaded and cached, or make "
        f"it available offline: load it once with network under the same HF_HOME to pre-cache it, put a copy laid "
        f"out like the hub repository at ${HUB_MIRROR_ENV}/{hub_id}, or pass a local .jsonl / .parquet file or a "
        "save_to_disk directory as the source."
    )


def _load(path: str, *, what: str, offline: bool = False, **kwargs: Any):
    import datasets

    try:
        return datasets.load_dataset(path, **kwargs)
    except (FileNotFoundError, ConnectionError, OSError) as error:
        if offline:
            raise OfflineSourceError(
                f"{what}: not in the local datasets cache, and offline mode ({' / '.join(OFFLINE_ENVS)} is set) "
                f"forbids downloading it. {_fixes(what)}"
            ) from error
        raise SourceNotFoundError(f"{what}: could not load the dataset ({type(error).__name__}: {error}). {_fixes(what)}") from error
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
        raise SourceNotFoundError(f"{what}: could not read the dataset ({type(error).__name__}: {error}). {_fixes(what)}") from error


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
