"""``train_supervised``: SFT on the training core (``posttrain.training.core.train``).

Everything a run guarantees — pipelining, LR schedule, checkpoints, exact resume after SIGKILL,
exactly-once metrics, evaluation cadence — is the core's; this module only binds SFT's recipe.
"""

from __future__ import annotations

from typing import Callable, Sequence

import pyarrow as pa
import tinker

from posttrain.checkpoints import CheckpointRecord
from posttrain.eval.base import Evaluator
from posttrain.metrics import MetricsLogger
from posttrain.supervised.config import SupervisedConfig
from posttrain.supervised.data import SupervisedData, as_supervised_data
from posttrain.supervised.recipe import SupervisedRecipe
from posttrain.training.core import TrainingResult, train

SupervisedResult = TrainingResult


def train_supervised(
    config: SupervisedConfig,
    data: SupervisedData | Sequence[tinker.Datum] | pa.Table,
    service_client: tinker.ServiceClient,
    *,
    evaluators: Sequence[Evaluator] = (),
    metrics_loggers: Sequence[MetricsLogger] = (),
    progress_logger: MetricsLogger | None = None,
    on_checkpoint: Callable[[CheckpointRecord], None] | None = None,
    data_version: str = "",
) -> TrainingResult:
    """Train (or resume) SFT on ``data``: a list of ``tinker.Datum``, a rendered-token Arrow table (its
    ``split == "train"`` rows when it has a split column), or any ``SupervisedData``."""
    recipe = SupervisedRecipe(config, as_supervised_data(data), data_version=data_version)
    return train(
        config.training,
        recipe,
        service_client,
        evaluators=evaluators,
        metrics_loggers=metrics_loggers,
        progress_logger=progress_logger,
        on_checkpoint=on_checkpoint,
    )
