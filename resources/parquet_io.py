"""Parquet storage for Arrow tables: every tabular asset (datasets, tokens, pairs, problems) goes here.

`ArrowParquetIOManager` is a `dg.UPathIOManager`: local paths and any fsspec store (s3://, gs://,
memory://) work, and partitioned assets get one file per partition (`<base>/<asset key>/<partition>.parquet`,
a dict of tables when several partitions are loaded). Writes are atomic: the table is written to a
hidden temporary file beside the target and renamed over it only when complete, so a failed or killed
materialization never leaves a half-written parquet file behind (and never destroys the previous one).

Every materialization of an unpartitioned asset also keeps an immutable copy,
`<base>/<asset key>.versions/<dagster run id>.parquet` (a hard link locally), named in the output
metadata as `parquet/version_path`: a checkpoint's manifest records it, so its eval reads exactly the
data it was trained on after the asset has been re-materialized.

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
            if not context.has_partition_key:
                self._keep_version(temporary, self.version_path(context, path))
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

    @staticmethod
    def version_path(context: dg.OutputContext, path: UPath) -> UPath:
        return path.parent / f"{path.stem}.versions" / f"{context.run_id}{path.suffix}"

    def _keep_version(self, source: UPath, target: UPath) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.protocol in LOCAL_PROTOCOLS:
            if os.path.exists(target.path):
                os.unlink(target.path)  # a retried step of the same run rewrites its own version
            os.link(source.path, target.path)
        else:
            source.fs.copy(source.path, target.path)

    def load_from_path(self, context: dg.InputContext, path: UPath) -> pa.Table:
        if not path.exists():
            raise FileNotFoundError(
                f"{path}: no stored table for {context.asset_key.to_user_string() if context.has_asset_key else 'input'}; "
                "materialize the upstream asset first"
            )
        with path.open("rb") as handle:
            return pq.read_table(handle)

    def get_metadata(self, context: dg.OutputContext, obj: Any) -> dict[str, Any]:
        metadata = {"parquet/num_rows": dg.MetadataValue.int(obj.num_rows), "parquet/columns": dg.MetadataValue.int(obj.num_columns)}
        if not context.has_partition_key:
            metadata["parquet/version_path"] = dg.MetadataValue.path(str(self.version_path(context, self._get_path(context))))
        return metadata


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
