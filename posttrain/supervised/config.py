"""Configuration of a supervised (SFT) run: the shared :class:`TrainingConfig` plus SFT's data fields.

Every field has a default so the Dagster launchpad, a sensor run, or ``python -m
posttrain.supervised.train --config '{}'`` can start a run without filling anything in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from posttrain.supervised.data import LOSS_REDUCTIONS, LossReduction
from posttrain.training.config import AdamConfig, TrainingConfig, config_from_dict, documented

__all__ = ["AdamConfig", "SupervisedConfig"]


@dataclass
class SupervisedConfig:
    training: TrainingConfig = field(default_factory=TrainingConfig)
    batch_size: int = documented(8, "Examples per optimizer step.")
    num_epochs: int = documented(1, "Passes over the training split.")
    shuffle: bool = documented(True, "Shuffle inside each epoch (a permutation seeded by (seed, epoch)).")
    loss_reduction: LossReduction = documented(
        "mean",
        "mean (cookbook default, alias example_mean: each example's weights sum to 1) | sum (raw weights) | "
        "token_mean (every trained token of the batch weighs equally).",
    )

    def __post_init__(self) -> None:
        if isinstance(self.training, dict):
            self.training = TrainingConfig(**self.training)
        self.validate()

    def validate(self) -> None:
        problems = list(self.training.problems())
        if self.loss_reduction not in LOSS_REDUCTIONS:
            problems.append(f"loss_reduction {self.loss_reduction!r} is not one of {LOSS_REDUCTIONS}")
        for name in ("batch_size", "num_epochs"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if problems:
            raise ValueError("invalid SupervisedConfig: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SupervisedConfig:
        return config_from_dict(cls, values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
