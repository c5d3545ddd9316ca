"""What an asset read: the latest materialization of an upstream asset, as plain values.

Training and evaluation record the exact upstream versions they consumed (data version, the run that
made it, its metadata) so a checkpoint can be traced back to its data and base model even after those
assets are re-materialized.
"""

import os
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

DATA_VERSION_TAG = "dagster/data_version"
INPUT_POINTER_TAG = "dagster/input_event_pointer/"
# Metadata of a materialization that chose among its upstream assets: the ones drawn as graph edges that it
# did not read. Dagster points at every parent's latest version; lineage must name only what was read.
UNREAD_INPUTS_KEY = "lineage/unread_inputs"


@dataclass(frozen=True)
class UpstreamVersion:
    asset_key: str
    data_version: str
    run_id: str
    storage_id: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def as_tags(self, prefix: str) -> dict[str, str]:
        return {f"{prefix}.data_version": self.data_version, f"{prefix}.dagster_run_id": self.run_id}


def latest_version(instance: dg.DagsterInstance, asset_key: str | dg.AssetKey) -> UpstreamVersion:
    """The latest materialization of ``asset_key``; a clear error when it was never materialized."""
    key = dg.AssetKey.from_coercible(asset_key)
    records = instance.fetch_materializations(key, limit=1).records
    if not records:
        raise dg.Failure(
            f"upstream asset {key.to_user_string()!r} has never been materialized on this Dagster instance "
            f"(DAGSTER_HOME); materialize it first, e.g. with the whole-chain job `sft_chain`."
        )
    return _version(key, records[0].event_log_entry, records[0].storage_id)


def unread_inputs_metadata(unread: list[str] | tuple[str, ...]) -> dict[str, dg.MetadataValue]:
    """Metadata naming the upstream assets a materialization chose not to read (see :func:`inputs_of`)."""
    return {UNREAD_INPUTS_KEY: dg.MetadataValue.json(sorted(unread))}


def inputs_of(instance: dg.DagsterInstance, version: UpstreamVersion) -> dict[str, UpstreamVersion]:
    """The exact upstream materializations ``version`` was computed from (Dagster's input event pointers),
    less those it recorded it did not read (:data:`UNREAD_INPUTS_KEY`)."""
    found = {}
    unread = set(version.metadata.get(UNREAD_INPUTS_KEY) or ())
    for tag, value in version.tags.items():
        if not tag.startswith(INPUT_POINTER_TAG) or not value.isdigit():  # "NULL": a dep never materialized
            continue
        key = dg.AssetKey.from_user_string(tag[len(INPUT_POINTER_TAG) :])
        if key.to_user_string() in unread:
            continue
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=key, storage_ids=[int(value)]), limit=1
        ).records
        if records:
            found[key.to_user_string()] = _version(key, records[0].event_log_entry, records[0].storage_id)
    return found


def _version(key: dg.AssetKey, event: Any, storage_id: int) -> UpstreamVersion:
    materialization = event.asset_materialization
    return UpstreamVersion(
        asset_key=key.to_user_string(),
        data_version=materialization.tags.get(DATA_VERSION_TAG, "") if materialization.tags else "",
        run_id=event.run_id,
        storage_id=storage_id,
        metadata={name: plain_value(value) for name, value in materialization.metadata.items()},
        tags=dict(materialization.tags or {}),
    )


VERSION_PATH_KEY = "parquet/version_path"


def read_versioned_table(metadata: dict[str, Any], what: str):
    """The exact table a materialization stored (its immutable parquet copy, named in its metadata)."""
    import pyarrow.parquet as pq

    path = metadata.get(VERSION_PATH_KEY)
    if not path or not os.path.exists(str(path)):
        raise dg.Failure(
            f"{what}: the stored copy {path!r} of that exact table version is missing (made under another "
            "POSTTRAIN_STATE_DIR, or before versions were kept): re-materialize it, or use the state dir it was made in"
        )
    return pq.read_table(str(path))


def plain_value(value: Any) -> Any:
    """A MetadataValue's payload as JSON-friendly Python (tables and markdown become text)."""
    inner = getattr(value, "value", value)
    if isinstance(inner, (str, int, float, bool, type(None), list, dict)):
        return inner
    return str(inner)
