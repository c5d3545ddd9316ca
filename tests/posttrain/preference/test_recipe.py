"""DpoRecipe on the real tinker SDK against the tiny-random localtinker server."""

import math

import pyarrow.parquet as pq
import pytest

from posttrain.preference.recipe import REFERENCE_FILE, DpoConfig, DpoRecipe
from posttrain.training.config import AdamConfig, TrainingConfig
from tests.posttrain.preference.tiny_pairs import TINY_MODEL, pairs_table


def _config(tmp_path, **overrides) -> DpoConfig:
    training = TrainingConfig(base_model=TINY_MODEL, lora_rank=4, learning_rate=5e-3, lr_schedule="constant", log_dir=str(tmp_path / "run"))
    return DpoConfig(training=training, **{"beta": 0.5, "batch_size": 4, "num_epochs": 4, **overrides})


def test_loss_starts_at_ln2_and_decreases(service_client, tmp_path):
    recipe = DpoRecipe(_config(tmp_path, shuffle=False), pairs_table(4))
    training_client = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=0).result()
    recipe.start(training_client, service_client, start_step=0)
    assert pq.read_table(tmp_path / "run" / REFERENCE_FILE).num_rows == 4
    adam = AdamConfig().params(5e-3)
    outcomes = [recipe.submit_step(step, training_client, adam).result() for step in range(recipe.num_steps())]
    losses = [outcome.metrics["dpo_loss"] for outcome in outcomes]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference snapshot at step 0
    assert outcomes[0].metrics["margin"] == pytest.approx(0.0, abs=1e-3)
    assert losses[-1] < losses[0] - 0.01, losses
    assert outcomes[-1].metrics["margin"] > 0 and outcomes[-1].metrics["accuracy"] > 0
    assert [outcome.metrics["epoch"] for outcome in outcomes] == [0.0, 1.0, 2.0, 3.0]
    assert all(outcome.metrics["num_pairs"] == 4.0 for outcome in outcomes)


def test_a_given_reference_table_is_used_without_recomputing(service_client, tmp_path):
    table = pairs_table(4)
    first = DpoRecipe(_config(tmp_path / "a"), table)
    training_client = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=0).result()
    first.start(training_client, service_client, start_step=0)
    second = DpoRecipe(_config(tmp_path / "b", beta=2.0), table, reference=first.reference_table)
    second.start(training_client, service_client, start_step=0)  # no snapshot, no file
    assert not (tmp_path / "b" / "run" / REFERENCE_FILE).exists()
    assert second.reference.by_row_id == first.reference.by_row_id
    assert second.identity()["reference_table"] is not None


def test_a_reference_of_other_pairs_is_refused(service_client, tmp_path):
    recipe = DpoRecipe(_config(tmp_path), pairs_table(2))
    training_client = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=0).result()
    recipe.start(training_client, service_client, start_step=0)
    with pytest.raises(ValueError, match=r"miss 2 of 4 pairs \(e.g. \['pair2', 'pair3'\]\)"):
        DpoRecipe(_config(tmp_path), pairs_table(4), reference=recipe.reference_table)


def test_resuming_without_the_step0_reference_is_refused(tmp_path):
    recipe = DpoRecipe(_config(tmp_path), pairs_table(4))
    with pytest.raises(FileNotFoundError, match="needs the reference logprobs of step 0"):
        recipe.start(None, None, start_step=3)
