"""What a user needs to see about a table before training on it: digest, token statistics, preview.

The digest is the sha256 of the table's Arrow IPC stream in a canonical form (one chunk, no schema
metadata, default nested-field names), so it depends only on column names, types and values, not on
how the table was built or whether it went through parquet; it is the asset's data version.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

TRAINED_OPEN, TRAINED_CLOSE = "⟦", "⟧"


def _canonical_type(data_type: pa.DataType) -> pa.DataType:
    """The type with default list-item names ("item"), recursively: parquet readers name them
    "element", which would otherwise change the digest of identical data."""
    if pa.types.is_list(data_type) or pa.types.is_large_list(data_type):
        return pa.list_(_canonical_type(data_type.value_type))
    if pa.types.is_struct(data_type):
        return pa.struct([pa.field(f.name, _canonical_type(f.type), f.nullable) for f in data_type])
    return data_type


def canonical(table: pa.Table) -> pa.Table:
    """`table` without schema metadata, with canonical nested types, in one chunk per column."""
    schema = pa.schema([pa.field(f.name, _canonical_type(f.type), f.nullable) for f in table.schema])
    return table.replace_schema_metadata(None).cast(schema).combine_chunks()


def data_digest(table: pa.Table) -> str:
    """sha256 hex of the canonical Arrow IPC bytes of `table` (schema + values, one record batch); the
    same after a parquet round trip."""
    combined = canonical(table)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, combined.schema) as writer:
        for batch in combined.to_batches(max_chunksize=max(1, combined.num_rows)):
            writer.write_batch(batch)
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()


def percentiles(values: Sequence[int]) -> dict[str, float]:
    """min / p50 / p90 / p99 / max / mean of a count column (zeros for an empty column)."""
    if len(values) == 0:
        return {"min": 0, "p50": 0, "p90": 0, "p99": 0, "max": 0, "mean": 0.0}
    array = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(array, [50, 90, 99])
    return {
        "min": int(array.min()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": int(array.max()),
        "mean": round(float(array.mean()), 2),
    }


def trained_fraction(num_trained: Sequence[int], num_targets: Sequence[int]) -> float:
    """Trained target tokens / all target tokens."""
    total = int(np.sum(num_targets)) if len(num_targets) else 0
    return float(np.sum(num_trained)) / total if total else 0.0


def mark_trained(tokens: Sequence[int], weights: Sequence[float], decode) -> str:
    """Decode `tokens` with each run of trained tokens (weight > 0) wrapped in ⟦…⟧; `weights[i]` is the
    weight of `tokens[i]` (unshifted)."""
    pieces, run, run_trained = [], [], None
    for token, weight in zip(tokens, weights, strict=True):
        trained = weight > 0
        if run and trained != run_trained:
            pieces.append(_decode_run(run, run_trained, decode))
            run = []
        run.append(token)
        run_trained = trained
    if run:
        pieces.append(_decode_run(run, run_trained, decode))
    return "".join(pieces)


def _decode_run(run: list[int], trained: bool, decode) -> str:
    text = decode(run)
    return f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}" if trained else text


def unshift(model_input: Sequence[int], targets: Sequence[int], weights: Sequence[float]) -> tuple[list[int], list[float]]:
    """The full sequence and per-token weights back from the shifted training layout."""
    tokens = list(model_input) + list(targets[-1:])
    return tokens, [0.0] + list(weights)


def preview_markdown(examples: list[tuple[str, str]], title: str) -> str:
    """Markdown with one fenced block per (row id, marked text) example."""
    lines = [f"**{title}** — trained tokens are shown between {TRAINED_OPEN} and {TRAINED_CLOSE}", ""]
    for row_id, text in examples:
        fence = "````" if "```" in text else "```"
        lines += [f"`{row_id}`", "", f"{fence}text", text, fence, ""]
    return "\n".join(lines)
