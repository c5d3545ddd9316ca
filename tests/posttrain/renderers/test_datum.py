"""Shifted training datums: targets are the next tokens, weights normalised per example, truncation reported."""

from __future__ import annotations

import numpy as np
import pytest
import tinker

from posttrain.datums import datum_weights
from posttrain.renderers import make_supervised_datum
from posttrain.renderers.datum import reduce_weights
from posttrain.supervised.data import apply_loss_reduction


def test_shift_and_mean_normalisation():
    tokens = [10, 11, 12, 13, 14]
    weights = np.array([0, 0, 1, 1, 1], dtype=np.float32)
    result = make_supervised_datum(tinker.ModelInput.from_ints(tokens), weights)
    datum = result.datum
    assert datum.model_input.to_ints() == [10, 11, 12, 13]
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [11, 12, 13, 14]
    assert datum.loss_fn_inputs["weights"].tolist() == pytest.approx([0, 1 / 3, 1 / 3, 1 / 3])
    assert not result.truncated and result.num_tokens == 5


def test_sum_keeps_raw_weights_and_truncation_is_reported():
    weights = np.array([0, 1, 1, 1, 1, 1], dtype=np.float32)
    result = make_supervised_datum([1, 2, 3, 4, 5, 6], weights, max_length=4, reduction="sum")
    assert result.truncated and result.original_num_tokens == 6 and result.num_tokens == 4
    assert result.datum.model_input.to_ints() == [1, 2, 3]
    assert result.datum.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4]
    assert result.datum.loss_fn_inputs["weights"].tolist() == [1.0, 1.0, 1.0]


def test_untrained_example_keeps_zero_weights_and_bad_input_is_named():
    result = make_supervised_datum([1, 2, 3], np.zeros(3, dtype=np.float32))
    assert result.datum.loss_fn_inputs["weights"].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="one entry per token"):
        make_supervised_datum([1, 2, 3], np.ones(2))
    with pytest.raises(ValueError, match="reduction"):
        make_supervised_datum([1, 2, 3], np.ones(3), reduction="median")


def test_one_weight_reduction_for_renderer_datums_and_training_batches():
    tokens, weights = [5, 6, 7, 8, 9], [0.0, 0.0, 1.0, 1.0, 1.0]
    raw = make_supervised_datum(tokens, weights, reduction="sum").datum
    for reduction in ("mean", "example_mean", "sum", "token_mean"):
        from_renderer = datum_weights(make_supervised_datum(tokens, weights, reduction=reduction).datum)
        from_trainer = datum_weights(apply_loss_reduction([raw], reduction)[0])
        assert from_renderer.tolist() == from_trainer.tolist(), reduction
    assert make_supervised_datum(tokens, weights).datum.loss_fn_inputs["weights"].to_numpy().sum() == pytest.approx(1.0)
    assert [w.tolist() for w in reduce_weights([np.ones(2), np.ones(6)], "token_mean")] == [[0.125] * 2, [0.125] * 6]
    with pytest.raises(ValueError, match="unknown loss reduction 'avg'"):
        reduce_weights([np.ones(2)], "avg")
