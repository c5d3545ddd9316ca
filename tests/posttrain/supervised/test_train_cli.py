"""``python -m posttrain.supervised.train``: config parsing, and one in-process run with both evaluators."""

import json

import pyarrow.parquet as pq
import pytest

from posttrain.datasets.schemas import RL_PROBLEMS, table_from_rows
from posttrain.metrics import read_metrics
from posttrain.supervised.train import load_config_argument, run
from tests.posttrain.supervised.tiny_data import TINY_MODEL, arithmetic_table, tiny_tokenizer


def test_config_argument_is_inline_json_or_a_file(tmp_path):
    assert load_config_argument('{"batch_size": 4}') == {"batch_size": 4}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"seed": 3}))
    assert load_config_argument(str(path)) == {"seed": 3}
    with pytest.raises(SystemExit, match="neither inline JSON nor an existing file"):
        load_config_argument(str(tmp_path / "missing.json"))


def test_unknown_or_missing_keys_are_named(tmp_path):
    with pytest.raises(SystemExit, match="train_data"):
        run({"batch_size": 2})
    with pytest.raises(ValueError, match=r"unknown SupervisedConfig fields \['batchsize'\]"):
        run({"train_data": "x.parquet", "batchsize": 2})


def test_run_trains_and_reports_heldout_nll_and_task_accuracy(tinker_server, tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    tokens_path, problems_path = tmp_path / "tokens.parquet", tmp_path / "problems.parquet"
    pq.write_table(arithmetic_table(tiny_tokenizer(), 12, split_every=4), tokens_path)  # 9 train, 3 held out
    problem_rows = [
        {"row_id": f"p{i}", "source": "test", "split": split, "task": "sum", "question": f"What is {i} + 1?",
         "answer": str(i + 1), "scorer": "exact_number", "scorer_metadata": "{}"}
        for i, split in enumerate(["heldout", "train", "heldout"])
    ]
    pq.write_table(table_from_rows(problem_rows, RL_PROBLEMS), problems_path)
    summary = run({
        "train_data": str(tokens_path), "eval_problems": str(problems_path), "accuracy_max_tokens": 4,
        "base_url": tinker_server.base_url, "base_model": TINY_MODEL, "lora_rank": 4, "batch_size": 3,
        "learning_rate": 1e-2, "log_dir": str(tmp_path / "run"),
    })
    assert summary["total_steps"] == 3 and summary["checkpoints"] == ["000003"]
    assert summary["sampler_path"].endswith("/sampler_weights/000003")
    final = summary["final_metrics"]
    assert final["eval/nll"] > 0 and final["eval/bpb"] > 0
    assert final["eval/num_samples"] == 2.0 and 0.0 <= final["eval/accuracy"] <= 1.0
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2] and "eval/accuracy" in rows[2]
