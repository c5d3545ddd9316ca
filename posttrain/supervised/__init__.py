"""Supervised fine-tuning over the tinker SDK: config, data batching, and the resumable loop.

Entry points: :func:`train_supervised` (library), ``python -m posttrain.supervised.train --config JSON``
(plain script, same loop).
"""

from posttrain.supervised.config import AdamConfig, SupervisedConfig
from posttrain.supervised.data import (
    DatumList,
    RenderedTokens,
    SupervisedData,
    apply_loss_reduction,
    as_supervised_data,
    batch_position,
    datum_from_tokens,
    epoch_order,
    get_batch,
    planned_steps,
)
from posttrain.supervised.loop import SupervisedResult, train_supervised

__all__ = [
    "AdamConfig",
    "DatumList",
    "RenderedTokens",
    "SupervisedConfig",
    "SupervisedData",
    "SupervisedResult",
    "apply_loss_reduction",
    "as_supervised_data",
    "batch_position",
    "datum_from_tokens",
    "epoch_order",
    "get_batch",
    "planned_steps",
    "train_supervised",
]
