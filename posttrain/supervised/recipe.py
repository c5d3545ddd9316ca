"""SFT as a training-core recipe: step ``s`` is one ``cross_entropy`` forward/backward on batch ``s``.

Batch ``s`` is a pure function of (data, batch size, seed, shuffle, ``s``) — see
``posttrain.supervised.data`` — which is what makes resume exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tinker

from posttrain.supervised.config import SupervisedConfig
from posttrain.supervised.data import SupervisedData, apply_loss_reduction, batch_position, datum_weights, get_batch
from posttrain.training.recipe import RecipeBase, StepOutcome


@dataclass
class _PendingSupervisedStep:
    batch: list[tinker.Datum]
    epoch: int
    forward_backward: Any
    optim_step: Any

    def result(self) -> StepOutcome:
        output = self.forward_backward.result()
        self.optim_step.result()
        nll_sum, trained_tokens = 0.0, 0
        for datum, loss_output in zip(self.batch, output.loss_fn_outputs):
            logprobs = np.asarray(loss_output["logprobs"].to_numpy(), dtype=np.float64).reshape(-1)
            trained = datum_weights(datum) > 0
            nll_sum -= float(logprobs[trained].sum())
            trained_tokens += int(trained.sum())
        return StepOutcome(
            metrics={
                "loss": nll_sum / max(trained_tokens, 1),  # mean NLL per trained token, whatever the reduction
                "loss_sum": float(output.metrics.get("loss:sum", float("nan"))),
                "num_sequences": float(len(self.batch)),
                "num_tokens": float(sum(datum.model_input.length for datum in self.batch)),
                "num_trained_tokens": float(trained_tokens),
                "epoch": float(self.epoch),
            }
        )


class SupervisedRecipe(RecipeBase):
    name = "sft"

    def __init__(self, config: SupervisedConfig, data: SupervisedData, data_version: str = ""):
        self.config, self.data, self.data_version = config, data, data_version
        self.num_batches = len(data) // config.batch_size
        if self.num_batches <= 0:
            raise ValueError(
                f"{len(data)} training examples make no complete batch of batch_size={config.batch_size}: "
                "add examples or lower batch_size"
            )

    def num_steps(self) -> int:
        return self.num_batches * self.config.num_epochs

    def identity(self) -> dict[str, Any]:
        config = self.config
        return {
            "batch_size": config.batch_size,
            "num_epochs": config.num_epochs,
            "shuffle": config.shuffle,
            "loss_reduction": config.loss_reduction,
            "num_examples": len(self.data),
            "data_version": self.data_version,
        }

    def submit_step(self, step: int, training_client: tinker.TrainingClient, adam: tinker.AdamParams) -> _PendingSupervisedStep:
        config = self.config
        position = batch_position(step, self.num_batches)
        batch = get_batch(self.data, config.batch_size, position.epoch, position.batch_index, config.training.seed, config.shuffle)
        batch = apply_loss_reduction(batch, config.loss_reduction)
        return _PendingSupervisedStep(
            batch=batch,
            epoch=position.epoch,
            forward_backward=training_client.forward_backward(batch, "cross_entropy"),
            optim_step=training_client.optim_step(adam),
        )
