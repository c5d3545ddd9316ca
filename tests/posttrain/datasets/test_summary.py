"""Digest, statistics and the trained-token preview."""

import pyarrow as pa
import pytest
import pyarrow.parquet as pq

from posttrain.datasets import schemas, summary


def tokens_table(values: list[int]) -> pa.Table:
    return pa.table({"row_id": ["a", "b"], "ids": pa.array([values, [9]], pa.list_(pa.int32()))})


def test_digest_depends_on_values_not_on_chunking_or_parquet(tmp_path):
    table = tokens_table([1, 2, 3])
    chunked = pa.concat_tables([table.slice(0, 1), table.slice(1, 1)])
    assert chunked.column("ids").num_chunks == 2
    pq.write_table(table, tmp_path / "t.parquet")
    digest = summary.data_digest(table)
    assert summary.data_digest(chunked) == digest == summary.data_digest(pq.read_table(tmp_path / "t.parquet"))
    assert summary.data_digest(tokens_table([1, 2, 4])) != digest
    assert summary.data_digest(table.rename_columns(["row_id", "other"])) != digest


def test_percentiles_and_trained_fraction():
    stats = summary.percentiles(list(range(1, 101)))
    assert (stats["min"], stats["max"], stats["p50"], stats["mean"]) == (1, 100, 50.5, 50.5)
    assert stats["p90"] == pytest.approx(90.1)
    assert summary.percentiles([]) ["max"] == 0
    assert summary.trained_fraction([1, 3], [4, 4]) == 0.5 and summary.trained_fraction([], []) == 0.0


def test_mark_trained_wraps_runs_of_trained_tokens():
    decode = lambda ids: "".join(chr(ord("a") + i) for i in ids)  # noqa: E731
    assert summary.mark_trained([0, 1, 2, 3, 4], [0, 0, 1, 1, 0], decode) == "ab⟦cd⟧e"
    assert summary.mark_trained([0, 1], [1, 1], decode) == "⟦ab⟧"
    full, weights = summary.unshift([0, 1, 2], [1, 2, 3], [0.0, 1.0, 1.0])
    assert (full, weights) == ([0, 1, 2, 3], [0.0, 0.0, 1.0, 1.0])


def test_schema_problems_name_each_difference():
    table = pa.table({"row_id": ["x"], "source": [1]})
    problems = schemas.schema_problems(table, schemas.CHAT)
    assert "column 'source' is int64, expected string" in problems
    assert "missing column 'messages' (list<item: struct<role: string, content: string>>)" in problems
    assert schemas.schema_problems(schemas.CHAT.empty_table(), schemas.CHAT) == []


def test_validate_table_raises_with_every_problem():
    table = pa.table({"row_id": ["x"], "extra": [1]})
    with pytest.raises(schemas.SchemaMismatch, match=r"'chat' schema: missing column 'source'.*unexpected columns \['extra'\]"):
        schemas.validate_table(table, schemas.CHAT)
