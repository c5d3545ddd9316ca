import numpy as np
import pyarrow as pa
import pytest

from posttrain.supervised.data import (
    DatumList,
    RenderedTokens,
    apply_loss_reduction,
    as_supervised_data,
    batch_indices,
    batch_position,
    datum_from_tokens,
    datum_weights,
    epoch_order,
    get_batch,
    planned_steps,
)


def _datum(i, trained=2):
    tokens = [i, i + 1, i + 2, i + 3]
    weights = [0.0] * (4 - trained) + [1.0] * trained
    return datum_from_tokens(tokens[:-1] + [i + 9], tokens[1:] + [i + 10], weights)


def test_every_example_once_per_epoch_and_order_depends_only_on_seed_and_epoch():
    first = epoch_order(10, epoch=0, seed=3)
    assert sorted(first.tolist()) == list(range(10))
    assert np.array_equal(first, epoch_order(10, epoch=0, seed=3))
    assert not np.array_equal(first, epoch_order(10, epoch=1, seed=3))
    assert not np.array_equal(first, epoch_order(10, epoch=0, seed=4))
    assert np.array_equal(epoch_order(5, 0, 0, shuffle=False), np.arange(5))


def test_batches_partition_the_epoch_and_drop_the_incomplete_tail():
    seen = np.concatenate([batch_indices(10, 3, epoch=2, batch_index=b, seed=1) for b in range(3)])
    assert len(set(seen.tolist())) == 9
    with pytest.raises(IndexError, match="3 batches of 3"):
        batch_indices(10, 3, epoch=0, batch_index=3, seed=1)


def test_step_to_epoch_and_batch_index_and_planned_steps():
    assert batch_position(7, 3) == batch_position(7, 3)
    position = batch_position(7, 3)
    assert (position.epoch, position.batch_index) == (2, 1)
    assert planned_steps(num_batches=3, num_epochs=4, max_steps=None) == 12
    assert planned_steps(num_batches=3, num_epochs=4, max_steps=5) == 5
    with pytest.raises(ValueError, match="no complete batch"):
        batch_position(0, 0)


def test_resumed_sequence_of_batches_equals_uninterrupted_one():
    data = DatumList([_datum(i) for i in range(11)])
    num_batches = len(data) // 2
    total = planned_steps(num_batches, 3, None)

    def tokens_of(step):
        position = batch_position(step, num_batches)
        return [d.model_input.to_ints() for d in get_batch(data, 2, position.epoch, position.batch_index, seed=5)]

    uninterrupted = [tokens_of(s) for s in range(total)]
    resumed_at = 7  # as if the log's last checkpoint said batch=7
    resumed = [tokens_of(s) for s in range(resumed_at)] + [
        tokens_of(s) for s in range(resumed_at, total)
    ]
    assert resumed == uninterrupted
    per_epoch = [sum(uninterrupted[e * 5 : (e + 1) * 5], []) for e in range(3)]
    assert all(len({tuple(t) for t in epoch}) == 10 for epoch in per_epoch)


def test_loss_reductions():
    batch = [_datum(0, trained=1), _datum(1, trained=3)]
    assert [datum_weights(d).sum() for d in apply_loss_reduction(batch, "sum")] == [1.0, 3.0]
    assert [datum_weights(d).sum() for d in apply_loss_reduction(batch, "example_mean")] == pytest.approx([1.0, 1.0])
    token_mean = apply_loss_reduction(batch, "token_mean")
    assert datum_weights(token_mean[1]).tolist() == pytest.approx([0.0, 0.25, 0.25, 0.25])
    assert [datum_weights(d).tolist() for d in apply_loss_reduction(batch, "mean")] == [
        datum_weights(d).tolist() for d in apply_loss_reduction(batch, "example_mean")
    ]  # the cookbook's name and the explicit one are the same reduction
    assert [datum_weights(d).tolist() for d in apply_loss_reduction(batch)] == [
        datum_weights(d).tolist() for d in apply_loss_reduction(batch, "mean")
    ]
    with pytest.raises(ValueError, match="unknown loss reduction 'median'"):
        apply_loss_reduction(batch, "median")


def test_datum_from_tokens_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="equal lengths"):
        datum_from_tokens([1, 2], [2], [1.0, 1.0])


def test_rendered_tokens_dataset_reads_arrow_columns_and_filters_split():
    table = pa.table(
        {
            "row_id": [f"r{i}" for i in range(6)],
            "split": ["train", "train", "heldout", "train", "train", "heldout"],
            "model_input": pa.array([[i, i + 1] for i in range(6)], pa.list_(pa.int32())),
            "target_tokens": pa.array([[i + 1, i + 2] for i in range(6)], pa.list_(pa.int32())),
            "weights": pa.array([[0.0, 1.0]] * 6, pa.list_(pa.float32())),
        }
    )
    train = RenderedTokens(table, split="train")
    assert len(train) == 4
    firsts = sorted(d.model_input.to_ints()[0] for b in range(2) for d in get_batch(train, 2, 0, b, seed=0))
    assert firsts == [0, 1, 3, 4]
    assert len(as_supervised_data(table)) == 4  # a table given directly trains on its train split only
    assert len(as_supervised_data(table.drop(["split"]))) == 6
    heldout = RenderedTokens(table, split="heldout").all_data()
    assert [d.model_input.to_ints() for d in heldout] == [[2, 3], [5, 6]]
    assert heldout[0].loss_fn_inputs["target_tokens"].to_numpy().tolist() == [3, 4]
    with pytest.raises(ValueError, match="lacks columns"):
        RenderedTokens(table.drop(["weights"]))
