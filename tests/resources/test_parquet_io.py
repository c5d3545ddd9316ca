"""ArrowParquetIOManager: real parquet files, partitions, atomic writes."""

from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from upath import UPath

from resources.parquet_io import ArrowParquetIOManager, ParquetIOManager


@dg.asset
def numbers() -> pa.Table:
    return pa.table({"x": pa.array([1, 2, 3], pa.int32())})


@dg.asset
def doubled(numbers: pa.Table) -> pa.Table:
    return pa.table({"x": pa.compute.multiply(numbers.column("x"), 2)})


letters = dg.StaticPartitionsDefinition(["a", "b"])


@dg.asset(partitions_def=letters)
def per_letter(context: dg.AssetExecutionContext) -> pa.Table:
    return pa.table({"letter": [context.partition_key] * 2})


@dg.asset(ins={"per_letter": dg.AssetIn()})
def all_letters(per_letter: dict[str, pa.Table]) -> pa.Table:
    return pa.concat_tables([per_letter[key] for key in sorted(per_letter)])


def test_round_trip_through_parquet_files(tmp_path: Path):
    result = dg.materialize([numbers, doubled], resources={"io_manager": ParquetIOManager(base_dir=str(tmp_path))})
    assert result.success
    assert pq.read_table(tmp_path / "numbers.parquet").column("x").to_pylist() == [1, 2, 3]
    assert pq.read_table(tmp_path / "doubled.parquet").column("x").to_pylist() == [2, 4, 6]
    metadata = result.asset_materializations_for_node("numbers")[0].metadata
    assert metadata["parquet/num_rows"].value == 3
    assert metadata["path"].value == str(tmp_path / "numbers.parquet")


def test_partitions_one_file_each_and_loaded_as_dict(tmp_path: Path):
    resources = {"io_manager": ParquetIOManager(base_dir=str(tmp_path))}
    for key in ("a", "b"):
        assert dg.materialize([per_letter], partition_key=key, resources=resources).success
    assert sorted(p.name for p in (tmp_path / "per_letter").iterdir()) == ["a.parquet", "b.parquet"]
    result = dg.materialize([per_letter.to_source_asset(), all_letters], resources=resources, selection=[all_letters])
    assert result.success
    assert pq.read_table(tmp_path / "all_letters.parquet").column("letter").to_pylist() == ["a", "a", "b", "b"]


def test_default_base_dir_is_the_instance_storage(tmp_path: Path):
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        assert dg.materialize([numbers], resources={"io_manager": ParquetIOManager()}, instance=instance).success
        assert (Path(instance.storage_directory()) / "parquet" / "numbers.parquet").is_file()


def test_failed_write_leaves_nothing_and_keeps_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    manager = ArrowParquetIOManager(base_path=UPath(tmp_path))
    target = UPath(tmp_path) / "t.parquet"
    context = dg.build_output_context(asset_key=dg.AssetKey("t"))
    manager.dump_to_path(context, pa.table({"v": [1]}), target)

    def fail_midway(table, where, **kwargs):
        where.write(b"PAR1 partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", fail_midway)
    with pytest.raises(OSError, match="disk full"):
        manager.dump_to_path(context, pa.table({"v": [2]}), target)
    monkeypatch.undo()
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["t.parquet", "t.versions"]
    assert pq.read_table(tmp_path / "t.parquet").column("v").to_pylist() == [1]
    (kept,) = (Path(tmp_path) / "t.versions").iterdir()  # only the successful write left a version
    assert pq.read_table(kept).column("v").to_pylist() == [1]


def test_non_table_output_is_rejected_without_writing(tmp_path: Path):
    @dg.asset
    def not_a_table() -> dict:
        return {"x": 1}

    result = dg.materialize(
        [not_a_table], resources={"io_manager": ParquetIOManager(base_dir=str(tmp_path))}, raise_on_error=False
    )
    assert not result.success
    assert "stores pyarrow.Table values, got dict" in str(result.all_events)
    assert list(Path(tmp_path).rglob("*.parquet")) == [] and list(Path(tmp_path).rglob("*.tmp")) == []


def test_memory_filesystem_through_fsspec():
    manager = ArrowParquetIOManager(base_path=UPath("memory://parquet-io-test"))
    target = UPath("memory://parquet-io-test/x.parquet")
    manager.make_directory(target.parent)
    manager.dump_to_path(dg.build_output_context(asset_key=dg.AssetKey("x")), pa.table({"v": [7]}), target)
    loaded = manager.load_from_path(dg.build_input_context(asset_key=dg.AssetKey("x")), target)
    assert loaded.column("v").to_pylist() == [7]
    assert sorted(p.name for p in target.parent.iterdir()) == ["x.parquet", "x.versions"]


def test_every_materialization_keeps_an_immutable_version_named_in_its_metadata(tmp_path: Path):
    """A checkpoint's manifest records this path, so its eval reads the data it was trained on after a re-run."""
    values = iter([[1, 2], [3]])

    @dg.asset
    def versioned() -> pa.Table:
        return pa.table({"v": next(values)})

    (tmp_path / "home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "home")) as instance:
        paths = []
        for _ in range(2):
            result = dg.materialize([versioned], instance=instance, resources={"io_manager": ParquetIOManager(base_dir=str(tmp_path))})
            (materialization,) = result.asset_materializations_for_node("versioned")
            paths.append(materialization.metadata["parquet/version_path"].value)
    assert paths[0] != paths[1]
    assert [pq.read_table(p).column("v").to_pylist() for p in paths] == [[1, 2], [3]]
    assert pq.read_table(tmp_path / "versioned.parquet").column("v").to_pylist() == [3]
