"""``DistillConfig``: on-policy distillation — what the student samples, who teaches it, and how strongly.

The student samples from an RL env (``posttrain.rl.envs``: the problems table, arithmetic ...); each
sampled token's advantage is the reverse-KL term against its group's teacher
(``posttrain.distill.advantages``), optionally plus ``reward_coef`` × the task reward's group advantage.
The loss is ``importance_sampling``; nothing is normalised beyond what a field names.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from posttrain.distill.teachers import ANY_DATASET
from posttrain.rl.config import RLConfig
from posttrain.training.config import TrainingConfig, documented

DISTILL_LOSS = "importance_sampling"


@dataclass
class DistillConfig:
    training: TrainingConfig = field(default_factory=TrainingConfig)
    # What the student samples (same envs as RL)
    env: str = documented(
        "arithmetic",
        "Prompt source the student samples on: 'problems' (the rl_problems table's train split), 'arithmetic', "
        "'guess_number', 'gsm8k' or 'reasoning_gym:<task>[,<task>...]'.",
    )
    env_options: dict[str, Any] = field(
        default_factory=dict, metadata={"doc": "Env options, as for RL (split, num_epochs, system, limit ...)."}
    )
    renderer: str = documented("auto", "Chat renderer of the prompts; auto = the base model's recommended one (chatml, llama3, qwen3 ...).")
    num_batches: int = documented(100, "Steps of a generated env (arithmetic); table envs have one step per groups_per_batch problems.")
    group_size: int = documented(4, "Student samples per prompt.")
    groups_per_batch: int = documented(8, "Prompts per optimizer step.")
    max_tokens: int = documented(64, "Student sampling budget per answer.")
    temperature: float = documented(1.0, "Student sampling temperature (> 0: the loss needs its logprobs of a real distribution).")
    # Who teaches
    teachers: dict[str, str] = field(
        default_factory=lambda: {ANY_DATASET: ""},
        metadata={
            "doc": "Dataset -> teacher. A dataset is a problem's task (rl_problems' task column) or the env name; "
            f"'{ANY_DATASET}' = every dataset not listed. A teacher is a checkpoint reference (Dagster: partition key, "
            "latest:<recipe>, best:<recipe>, tinker:// path; library: a tinker:// sampler path) or empty = the base model."
        },
    )
    # How strongly
    kl_coef: float = documented(1.0, "Weight of the per-token reverse KL: advantage_t += -kl_coef*(lp_student_t - lp_teacher_t).")
    kl_discount: float = documented(0.0, "Discount of later tokens' KL advantages summed into each token (0 = per token only).")
    reward_coef: float = documented(0.0, "> 0: also add reward_coef x the task reward's group advantage (RL + distillation); 0 = pure distillation.")
    format_coef: float = documented(0.1, "Task reward's format penalty (only matters when reward_coef > 0 or for the reward metric).")
    num_substeps: int = documented(1, "forward_backward calls per step (gradients accumulate into one optim_step).")

    def __post_init__(self) -> None:
        if isinstance(self.training, dict):
            self.training = TrainingConfig(**self.training)

    def rl_config(self) -> RLConfig:
        """The RL settings the shared rollout/datum/loss pieces read (one sync step, no group filtering)."""
        return RLConfig(
            training=self.training,
            env=self.env,
            env_options=dict(self.env_options),
            renderer=self.renderer,
            num_batches=self.num_batches,
            format_coef=self.format_coef,
            group_size=self.group_size,
            groups_per_batch=self.groups_per_batch,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            loss_fn=DISTILL_LOSS,
            num_substeps=self.num_substeps,
            remove_constant_reward_groups=False,  # a constant-reward group still has a teacher signal
            mode="sync",
        )

    def problems(self) -> list[str]:
        found = self.rl_config().problems()
        if self.kl_coef < 0 or self.reward_coef < 0:
            found.append(f"kl_coef ({self.kl_coef}) and reward_coef ({self.reward_coef}) must be >= 0")
        if self.kl_coef == 0 and self.reward_coef == 0:
            found.append("kl_coef and reward_coef are both 0: the student would learn nothing; set kl_coef > 0")
        if not 0.0 <= self.kl_discount < 1.0:
            found.append(f"kl_discount must be in [0, 1), got {self.kl_discount}")
        if not self.teachers:
            found.append(f"teachers is empty: name one teacher for '{ANY_DATASET}' or one per dataset")
        if any(not str(key).strip() for key in self.teachers):
            found.append(f"teachers has an empty dataset name; use '{ANY_DATASET}' for every dataset")
        return found

    def validate(self) -> None:
        found = self.problems()
        if found:
            raise ValueError("invalid DistillConfig: " + "; ".join(found))

    def identity(self) -> dict[str, Any]:
        """The fields that fix what step k trains on (teachers as given; the recipe adds the resolved paths)."""
        values = asdict(self)
        values.pop("training")
        return values
