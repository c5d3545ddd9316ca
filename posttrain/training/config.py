"""What every training run shares, whatever the recipe: model, optimiser, schedule, checkpoints.

A recipe's own config (``SupervisedConfig``, ``DpoConfig``, ``RLConfig`` ...) *contains* a
:class:`TrainingConfig` under ``training``; the Dagster configs derive their launchpad fields from these
dataclasses (one field list, not two). Every field has a default so a sensor run or ``--config '{}'``
can start as is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import tinker

from posttrain.schedules import LR_SCHEDULES, LRSchedule

# Twin of localtinker.engine.packaged.SMOLLM2_NAME, the model localtinker ships (posttrain may not import
# localtinker); tests/test_twin_constants.py checks that they agree.
DEFAULT_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def documented(default: Any, doc: str) -> Any:
    """A dataclass field with a default and a description (shown in the Dagster launchpad)."""
    return field(default=default, metadata={"doc": doc})


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

    def problems(self) -> list[str]:
        found = []
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                found.append(f"adam.{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            found.append(f"adam.eps must be positive, got {self.eps}")
        for name in ("weight_decay", "grad_clip_norm"):
            if getattr(self, name) < 0:
                found.append(f"adam.{name} must be >= 0, got {getattr(self, name)}")
        return found


@dataclass
class TrainingConfig:
    """The part of a run the training core owns (``posttrain.training.core.train``)."""

    base_model: str = documented(DEFAULT_BASE_MODEL, "Base model (the Dagster asset fills this from base_model).")
    lora_rank: int = documented(32, "LoRA rank (ignored when starting from init_from: the checkpoint's rank is kept).")
    init_from: str | None = documented(
        None, "A tinker:// state to start from (its LoRA weights; Adam starts fresh). None: a fresh LoRA on base_model."
    )
    learning_rate: float = documented(1e-4, "Peak Adam learning rate.")
    lr_schedule: LRSchedule = documented("linear", "Learning-rate multiplier per step: linear decay, cosine or constant.")
    warmup_steps: int = documented(0, "Linear warm-up steps before the schedule.")
    adam: AdamConfig = field(
        default_factory=AdamConfig, metadata={"doc": "Adam betas, eps, decoupled weight decay, grad clip norm (0 = off)."}
    )
    max_steps: int | None = documented(None, "Cap on optimizer steps; None/0 = every step the recipe's data supports.")
    seed: int = documented(0, "Seed of data order, LoRA initialisation and sampling.")
    log_dir: str = documented("runs/train", "Where checkpoints.jsonl, run.json and metrics live (resume reads it).")
    save_every: int = documented(10, "Steps between checkpoints (each one evaluated); 0 = only the final one.")
    eval_every: int = documented(0, "Steps between in-loop evaluations; 0 = only after the last step.")
    checkpoint_ttl_seconds: int | None = documented(None, "Server-side expiry of saved checkpoints; None = keep.")

    def __post_init__(self) -> None:
        if isinstance(self.adam, dict):
            self.adam = AdamConfig(**self.adam)

    def problems(self) -> list[str]:
        """Every invalid value, phrased as 'field: what is wrong' (empty when valid)."""
        found = list(self.adam.problems())
        if self.lr_schedule not in LR_SCHEDULES:
            found.append(f"lr_schedule {self.lr_schedule!r} is not one of {LR_SCHEDULES}")
        if self.lora_rank <= 0:
            found.append(f"lora_rank must be positive, got {self.lora_rank}")
        for name in ("warmup_steps", "save_every", "eval_every"):
            if getattr(self, name) < 0:
                found.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 0:
            found.append(f"max_steps must be positive, or 0/None for no cap, got {self.max_steps}")
        if not self.learning_rate > 0:
            found.append(f"learning_rate must be positive, got {self.learning_rate}")
        if self.init_from is not None and not self.init_from.startswith("tinker://"):
            found.append(f"init_from must be a tinker:// state path or None, got {self.init_from!r}")
        return found

    def flat_params(self) -> dict[str, Any]:
        """``adam.beta1``-style flat keys, for params loggers (MLflow)."""
        flat = {key: value for key, value in asdict(self).items() if key != "adam"}
        flat.update({f"adam.{key}": value for key, value in asdict(self.adam).items()})
        return flat


def config_from_dict(cls: type, values: dict[str, Any]):
    """Build dataclass ``cls`` from ``values``, naming unknown keys (nested dataclasses accept dicts).

    For a recipe config with a ``training`` field, :class:`TrainingConfig` keys may also be given at the
    top level (``{"learning_rate": 1e-3, "batch_size": 4}``): they are moved under ``training``.
    """
    values = dict(values)
    known = {f.name for f in fields(cls)}
    if "training" in known:
        lifted = {key: values.pop(key) for key in [k for k in values if k in _TRAINING_FIELDS]}
        if lifted:
            values["training"] = {**(values.get("training") or {}), **lifted}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {unknown}; known: {sorted(known)}")
    return cls(**values)


_TRAINING_FIELDS = frozenset(f.name for f in fields(TrainingConfig))

