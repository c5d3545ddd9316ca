"""Token tables carry the identity of their tokenizer, and training can refuse a mismatch."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from posttrain.datasets import schemas
from posttrain.datasets.tokens import (
    TokenizerIdentity,
    TokenizerMismatch,
    check_tokenizer_matches,
    recorded_tokenizer,
    tokenizer_digest,
    tokenizer_identity,
    with_tokenizer_identity,
)
from resources.models import tokenizer_path
from tests.fixtures.data import TINY_MODEL


@pytest.fixture(scope="module")
def fresh_tokenizers():
    path = tokenizer_path(TINY_MODEL)
    same, extended = AutoTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    extended.add_tokens(["<extra_token>"])
    return same, extended


def test_digest_is_stable_across_loads_and_calls_and_sees_a_changed_vocabulary(data_tokenizer, fresh_tokenizers):
    same, extended = fresh_tokenizers
    before = tokenizer_digest(same)
    same("a long text " * 50, truncation=True, max_length=8)  # per-call state must not change the identity
    assert tokenizer_digest(same) == before == tokenizer_digest(data_tokenizer)
    assert tokenizer_digest(extended) != before


def test_identity_travels_in_the_parquet_schema(tmp_path, data_tokenizer):
    identity = tokenizer_identity(data_tokenizer, TINY_MODEL)
    table = with_tokenizer_identity(schemas.table_from_rows([], schemas.RENDERED_TOKENS), identity)
    assert table.schema.metadata[b"posttrain.schema"] == b"rendered_tokens"  # existing metadata kept
    pq.write_table(table, tmp_path / "t.parquet")
    assert recorded_tokenizer(pq.read_table(tmp_path / "t.parquet")) == identity
    assert recorded_tokenizer({"tokenizer_name": TINY_MODEL, "tokenizer_digest": identity.digest}) == identity
    assert recorded_tokenizer(pa.table({"x": [1]})) is None


def test_mismatch_names_both_tokenizers(data_tokenizer, fresh_tokenizers):
    rendered = tokenizer_identity(data_tokenizer, TINY_MODEL)
    table = with_tokenizer_identity(pa.table({"x": [1]}), rendered)
    assert check_tokenizer_matches(table, TokenizerIdentity("another/name", rendered.digest)) == rendered
    expected = tokenizer_identity(fresh_tokenizers[1], "my/extended-model")
    with pytest.raises(TokenizerMismatch, match=r"rendered with 'localtinker/tiny-random'.*uses 'my/extended-model'"):
        check_tokenizer_matches(table, expected)
    with pytest.raises(TokenizerMismatch, match="records no tokenizer"):
        check_tokenizer_matches(pa.table({"x": [1]}), expected)
