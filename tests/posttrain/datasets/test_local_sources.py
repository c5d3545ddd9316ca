"""Local JSONL / parquet files with column mappings, splits and row ids."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.datasets.loaders import LoadSpec, load
from posttrain.datasets.splits import split_of


def test_jsonl_messages_with_row_ids_from_lines(chat_jsonl):
    table = load(LoadSpec("chat", str(chat_jsonl))).table.to_pylist()
    assert [r["row_id"] for r in table[:2]] == ["chat.jsonl/train/line1", "chat.jsonl/train/line2"]
    assert table[3]["messages"][1] == {"role": "assistant", "content": "6"}


def test_jsonl_prompt_completion_mapping(write_jsonl):
    path = write_jsonl(
        [{"instruction": "Add 1 and 2", "output": "3", "sys": "Be terse."}, {"instruction": "Add 2 and 2", "output": "4", "sys": ""}]
    )
    spec = LoadSpec("chat", str(path), columns={"prompt": "instruction", "completion": "output", "system": "sys"})
    table = load(spec).table.to_pylist()
    assert table[0]["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Add 1 and 2"},
        {"role": "assistant", "content": "3"},
    ]
    assert [m["role"] for m in table[1]["messages"]] == ["user", "assistant"]


def test_parquet_comparisons_with_text_columns(tmp_path):
    path = tmp_path / "prefs.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "2+2?", "good": "4", "bad": "5"}, {"q": "3+3?", "good": "6", "bad": "7"}]), path)
    table = load(LoadSpec("comparison", str(path), columns={"prompt": "q", "chosen": "good", "rejected": "bad"})).table
    first = table.to_pylist()[0]
    assert first["prompt"] == [{"role": "user", "content": "2+2?"}]
    assert (first["chosen"][0]["content"], first["rejected"][0]["content"]) == ("4", "5")


def test_jsonl_rl_problems_numeric_answers(write_jsonl):
    path = write_jsonl([{"q": "1+1", "a": 2}, {"q": "capital of France", "a": "Paris"}])
    table = load(LoadSpec("rl", str(path), columns={"question": "q", "answer": "a"})).table.to_pylist()
    assert [(r["answer"], r["scorer"]) for r in table] == [("2", "exact_number"), ("Paris", "exact_match")]


def test_limit_and_heldout_fraction(chat_jsonl):
    table = load(LoadSpec("chat", str(chat_jsonl), limit=4, heldout_fraction=0.5)).table
    assert table.num_rows == 4
    prompts = [r["messages"][0]["content"] for r in table.to_pylist()]
    assert table.column("split").to_pylist() == [split_of(p, 0.5) for p in prompts]
