"""Bad input is a clear error naming file, line/row and problem, or a counted, sampled skip."""

from __future__ import annotations

import pytest

from posttrain.datasets.loaders import LoadSpec, load
from posttrain.datasets.rows import BadRowError, EmptyDatasetError
from tests.fixtures.data import chat_line

GOOD = chat_line("Hi", "Hello")


def test_malformed_json_line_names_file_and_line(write_jsonl):
    path = write_jsonl([GOOD, '{"messages": [{"role": "user", "content": "x"}', GOOD])
    with pytest.raises(BadRowError) as error:
        load(LoadSpec("chat", str(path)))
    assert str(path) in str(error.value) and "line 2" in str(error.value) and "malformed JSON" in str(error.value)


def test_missing_role_names_line_and_message(write_jsonl):
    path = write_jsonl([GOOD, GOOD, {"messages": [{"content": "no role"}, {"role": "assistant", "content": "a"}]}])
    with pytest.raises(BadRowError, match=r"line 3 message 0: message has no 'role'"):
        load(LoadSpec("chat", str(path)))


def test_non_string_content(write_jsonl):
    path = write_jsonl([{"messages": [{"role": "user", "content": 42}, {"role": "assistant", "content": "a"}]}])
    with pytest.raises(BadRowError, match=r"line 1 message 0: user message content is int, expected a string"):
        load(LoadSpec("chat", str(path)))


def test_unknown_role_and_missing_column(write_jsonl):
    path = write_jsonl([{"messages": [{"role": "narrator", "content": "x"}]}])
    with pytest.raises(BadRowError, match="unknown role 'narrator'"):
        load(LoadSpec("chat", str(path)))
    path = write_jsonl([{"conversation": []}], name="other.jsonl")
    with pytest.raises(BadRowError, match=r"other.jsonl line 1: missing column 'messages' \(columns present: \['conversation'\]\)"):
        load(LoadSpec("chat", str(path)))


def test_skip_bad_rows_counts_and_samples(write_jsonl):
    path = write_jsonl(
        [GOOD, "not json", {"messages": [{"role": "user", "content": 1}]}, GOOD, {"messages": [{"role": "user", "content": "q"}]}]
    )
    loaded = load(LoadSpec("chat", str(path), skip_bad_rows=True))
    assert loaded.table.num_rows == 2
    assert loaded.skipped.count == 3
    assert "line 2: malformed JSON" in loaded.skipped.samples[0]
    assert "line 3 message 0: user message content is int" in loaded.skipped.samples[1]
    assert "line 5: conversation has no assistant message" in loaded.skipped.samples[2]


def test_empty_dataset_is_an_error_even_when_skipping(write_jsonl):
    with pytest.raises(EmptyDatasetError, match="no usable chat rows"):
        load(LoadSpec("chat", str(write_jsonl([]))))
    with pytest.raises(EmptyDatasetError, match="1 bad rows skipped"):
        load(LoadSpec("chat", str(write_jsonl(["{"], name="b.jsonl")), skip_bad_rows=True))


def test_identical_completions_and_mismatched_prompts(write_jsonl):
    same = write_jsonl([{"prompt": "q", "chosen": "a", "rejected": "a"}])
    with pytest.raises(BadRowError, match="chosen and rejected completions are identical"):
        load(LoadSpec("comparison", str(same)))
    convo = lambda q, a: [{"role": "user", "content": q}, {"role": "assistant", "content": a}]  # noqa: E731
    mismatch = write_jsonl([{"chosen": convo("q1", "a"), "rejected": convo("q2", "b")}], name="m.jsonl")
    with pytest.raises(BadRowError, match="do not share the same prompt turns"):
        load(LoadSpec("comparison", str(mismatch)))


def test_bad_preset_row_names_dataset_split_and_row(hub_mirror, tmp_path):
    import shutil

    copy = tmp_path / "gsm8k"
    shutil.copytree(hub_mirror / "openai" / "gsm8k", copy)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["q"], "answer": ["no final answer"]}), copy / "main" / "train-00000-of-00001.parquet")
    with pytest.raises(BadRowError, match=r"\[train\] row 0: answer has no '#### <number>' final answer"):
        load(LoadSpec("rl", "gsm8k", path=str(copy)))


def test_unsupported_file_type_and_missing_file(tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(FileNotFoundError, match="unsupported file type"):
        load(LoadSpec("chat", str(tmp_path / "data.csv")))
    with pytest.raises(FileNotFoundError, match="no such file"):
        load(LoadSpec("chat", str(tmp_path / "missing.jsonl")))
