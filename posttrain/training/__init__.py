"""The training core every recipe runs on: config, the recipe protocol, and the resumable loop."""

from posttrain.training.config import AdamConfig, TrainingConfig, config_from_dict
from posttrain.training.core import ResumeMismatchError, TrainingResult, train
from posttrain.training.recipe import DoneStep, PendingStep, Recipe, RecipeBase, RowSink, StepOutcome
from posttrain.training.rows import JsonlRowSink

__all__ = [
    "AdamConfig",
    "DoneStep",
    "JsonlRowSink",
    "PendingStep",
    "Recipe",
    "RecipeBase",
    "ResumeMismatchError",
    "RowSink",
    "StepOutcome",
    "TrainingConfig",
    "TrainingResult",
    "config_from_dict",
    "train",
]
