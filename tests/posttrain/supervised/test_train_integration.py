"""The supervised loop through the real tinker SDK against an in-process localtinker (tiny model)."""

import math

import pytest

from posttrain.checkpoints import read_checkpoints
from posttrain.eval import NllEvaluator
from posttrain.metrics import JsonlMetricsLogger, read_metrics
from posttrain.supervised import SupervisedConfig, train_supervised
from tests.posttrain.supervised.tiny_data import TINY_MODEL, arithmetic_data, tiny_tokenizer


@pytest.fixture
def tokenizer():
    return tiny_tokenizer()


def test_loss_falls_on_a_repeated_batch_with_checkpoints_evals_and_metrics(service_client, tokenizer, tmp_path):
    data = arithmetic_data(tokenizer, 4)
    config = SupervisedConfig.from_dict(dict(
        base_model=TINY_MODEL, lora_rank=8, learning_rate=3e-2, lr_schedule="linear", batch_size=2,
        num_epochs=4, save_every=3, eval_every=4, log_dir=str(tmp_path / "run"), seed=1,
    ))
    seen = []
    metrics_path = tmp_path / "run" / "metrics.jsonl"
    result = train_supervised(
        config, data, service_client,
        evaluators=[NllEvaluator(data[:2], prefix="heldout/")],
        metrics_loggers=[JsonlMetricsLogger(metrics_path)],
        on_checkpoint=seen.append,
    )

    assert result.total_steps == 8 and result.start_step == 0
    assert [record.batch for record in result.checkpoints] == [3, 6, 8]
    assert seen == result.new_checkpoints == read_checkpoints(config.training.log_dir)
    assert [record.final for record in result.checkpoints] == [False, False, True]
    for record in result.checkpoints:
        assert record.state_path.startswith("tinker://") and record.state_path.endswith(f"/weights/{record.name}")
        assert record.sampler_path.endswith(f"/sampler_weights/{record.name}")
    assert result.sampler_path == result.checkpoints[-1].sampler_path

    rows = read_metrics(metrics_path)
    assert [row["step"] for row in rows] == list(range(8))
    assert [row["learning_rate"] for row in rows] == pytest.approx([3e-2 * (1 - s / 8) for s in range(8)])
    losses = [row["loss"] for row in rows]
    assert all(math.isfinite(loss) for loss in losses)
    assert (losses[-1] + losses[-2]) < 0.6 * (losses[0] + losses[1]), losses
    assert all(row["num_trained_tokens"] > 0 and row["tokens_per_second"] > 0 for row in rows)
    evaluated = [row for row in rows if "heldout/nll" in row]
    assert [row["step"] for row in evaluated] == [3, 7]
    assert all(0 < row["heldout/nll"] < 0.5 * losses[0] and 0 < row["heldout/bpb"] < 10 for row in evaluated)
    assert result.final_metrics["heldout/nll"] == evaluated[1]["heldout/nll"]
    assert result.final_metrics["loss"] == losses[-1]
