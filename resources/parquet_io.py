"""Parquet storage for Arrow tables: every tabular asset (datasets, tokens, pairs, problems) goes here.

`ArrowParquetIOManager` is a `dg.UPathIOManager`: local paths and any fsspec store (s3://, gs://,
memory://) work, and partitioned assets get one file per partition (`<base>/<asset key>/<partition>.parquet`,
a dict of tables when several partitions are loaded). Writes are atomic: the table is written to a
hidden temporary file beside the target and renamed over it only when complete, so a failed or killed
materialization never leaves a half-written parquet file behind (and never destroys the previous one).

Wire it in Definitions as `ParquetIOManager(base_dir=...)`; with no `base_dir` it stores under the
Dagster instance's storage directory (`$DAGSTER_HOME/storage/parquet`).
"""

import os
import uuid
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
from dagster._core.storage.upath_io_manager import escape_dotdot_segments
from pydantic import Field
from upath import UPath

LOCAL_PROTOCOLS = ("", "file", "local")


class ArrowParquetIOManager(dg.UPathIOManager):
    """Stores `pyarrow.Table` outputs as parquet (zstd) and loads them back as tables."""

    extension = ".parquet"

    def make_safe_partition_path(self, base_path: UPath, partition: str) -> UPath:
        return base_path / escape_dotdot_segments(partition.lstrip("/"))

    def dump_to_path(self, context: dg.OutputContext, obj: Any, path: UPath) -> None:
        if not isinstance(obj, pa.Table):
            raise TypeError(
                f"{context.asset_key.to_user_string() if context.has_asset_key else 'output'}: "
                f"ArrowParquetIOManager stores pyarrow.Table values, got {type(obj).__name__}"
            )
        temporary = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
        try:
            with temporary.open("wb") as handle:
                pq.write_table(obj, handle, compression="zstd")
            self._replace(temporary, path)
        except BaseException:
            if temporary.exists():
                temporary.unlink()
            raise

    def _replace(self, source: UPath, target: UPath) -> None:
        if source.protocol in LOCAL_PROTOCOLS:
            os.replace(source.path, target.path)
        else:
            source.fs.mv(source.path, target.path)

    def load_from_path(self, context: dg.InputContext, path: UPath) -> pa.Table:
        if not path.exists():
            raise FileNotFoundError(
                f"{path}: no stored table for {context.asset_key.to_user_string() if context.has_asset_key else 'input'}; "
                "materialize the upstream asset first"
            )
        with path.open("rb") as handle:
            return pq.read_table(handle)

    def get_metadata(self, context: dg.OutputContext, obj: Any) -> dict[str, Any]:
        return {"parquet/num_rows": dg.MetadataValue.int(obj.num_rows), "parquet/columns": dg.MetadataValue.int(obj.num_columns)}


class ParquetIOManager(dg.ConfigurableIOManagerFactory):
    """Configurable factory for `ArrowParquetIOManager` (use this one in Definitions)."""

    base_dir: str | None = Field(
        default=None,
        description="Root directory or fsspec URL for parquet files; default: <DAGSTER_HOME storage>/parquet.",
    )

    def create_io_manager(self, context: dg.InitResourceContext) -> ArrowParquetIOManager:
        base = self.base_dir
        if base is None:
            if context.instance is None:
                raise ValueError("ParquetIOManager needs base_dir when no Dagster instance is available")
            base = os.path.join(context.instance.storage_directory(), "parquet")
        return ArrowParquetIOManager(base_path=UPath(base))
