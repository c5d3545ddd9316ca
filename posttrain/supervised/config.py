"""Configuration of a supervised (SFT) run, grouped by concern and JSON round-trippable.

Every field has a default so the Dagster launchpad, a sensor run, or ``python -m
posttrain.supervised.train --config '{}'`` can start a run without filling anything in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import tinker

from posttrain.schedules import LR_SCHEDULES
from posttrain.supervised.data import LOSS_REDUCTIONS


@dataclass
class AdamConfig:
    """Per-step Adam settings (Tinker's defaults; weight decay is decoupled, clip 0 = off)."""

    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def params(self, learning_rate: float) -> tinker.AdamParams:
        return tinker.AdamParams(learning_rate=learning_rate, **asdict(self))


@dataclass
class SupervisedConfig:
    # Model
    base_model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    lora_rank: int = 32
    # Optimisation
    learning_rate: float = 1e-4
    lr_schedule: str = "linear"  # linear | cosine | constant
    warmup_steps: int = 0
    adam: AdamConfig = field(default_factory=AdamConfig)
    loss_reduction: str = "example_mean"  # sum | example_mean | token_mean (see data.apply_loss_reduction)
    # Data order
    batch_size: int = 8
    num_epochs: int = 1
    max_steps: int | None = None  # None: every batch of every epoch
    seed: int = 0  # shuffling and LoRA initialisation
    shuffle: bool = True
    # Checkpoints, evaluation, logs
    log_dir: str = "runs/sft"
    save_every: int = 0  # steps between checkpoints; 0 = only the final one
    eval_every: int = 0  # steps between evaluations; 0 = only after the last step (when evaluators are given)
    checkpoint_ttl_seconds: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.adam, dict):
            self.adam = AdamConfig(**self.adam)
        self.validate()

    def validate(self) -> None:
        problems = []
        if self.lr_schedule not in LR_SCHEDULES:
            problems.append(f"lr_schedule {self.lr_schedule!r} is not one of {LR_SCHEDULES}")
        if self.loss_reduction not in LOSS_REDUCTIONS:
            problems.append(f"loss_reduction {self.loss_reduction!r} is not one of {LOSS_REDUCTIONS}")
        for name in ("batch_size", "num_epochs", "lora_rank"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("warmup_steps", "save_every", "eval_every"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps <= 0:
            problems.append(f"max_steps must be positive or None, got {self.max_steps}")
        if not self.learning_rate > 0:
            problems.append(f"learning_rate must be positive, got {self.learning_rate}")
        if problems:
            raise ValueError("invalid SupervisedConfig: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SupervisedConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown SupervisedConfig fields {unknown}; known: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def flat_params(self) -> dict[str, Any]:
        """``adam.beta1``-style flat keys, for params loggers (MLflow)."""
        flat = {key: value for key, value in asdict(self).items() if key != "adam"}
        flat.update({f"adam.{key}": value for key, value in asdict(self.adam).items()})
        return flat
