"""``RLConfig``: what an RL run trains on and how; the model/optimiser/checkpoint part is ``training``.

Every normalisation choice is a named field with the cookbook's default: advantages are centred per
group and *not* divided by the group's std; constant-reward groups are removed; no KL penalty.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

from posttrain.training.config import TrainingConfig, documented

LossName = Literal["importance_sampling", "ppo", "cispo", "dro", "gspo"]
Mode = Literal["sync", "streaming", "async"]
StalePolicy = Literal["drop", "requeue"]
KLReference = Literal["parent", "base"]
LOSS_NAMES: tuple[str, ...] = get_args(LossName)
MODES: tuple[str, ...] = get_args(Mode)
STALE_POLICIES: tuple[str, ...] = get_args(StalePolicy)
KL_REFERENCES: tuple[str, ...] = get_args(KLReference)


@dataclass
class RLConfig:
    training: TrainingConfig = field(default_factory=TrainingConfig)
    # What to train on (posttrain.rl.envs.build_rl_dataset)
    env: str = documented(
        "arithmetic",
        "Environment: 'problems' = the rows of the rl_problems table (train split), each played by its env: a "
        "single-turn problem graded by its scorer, or a generated env's instance (arithmetic, guess_number secrets); "
        "pick the env and source in rl_problems' config. Training assets accept only 'problems'; library scripts may "
        "also generate 'arithmetic' / 'guess_number' or load 'gsm8k' / 'reasoning_gym:<task>' themselves.",
    )
    env_options: dict[str, Any] = field(
        default_factory=dict,
        metadata={"doc": "Env options: problems/gsm8k/reasoning_gym take split, num_epochs, system (gsm8k/reasoning_gym "
                         "also limit); guess_number takes low, high, max_turns; arithmetic none."},
    )
    renderer: str = documented("auto", "Chat renderer that turns problems into prompts and parses answers; auto = the base model's recommended one (chatml, llama3, qwen3 ...).")
    num_batches: int = documented(100, "Steps of a generated env (arithmetic, guess_number); table envs have one step per groups_per_batch problems.")
    format_coef: float = documented(0.1, "Reward penalty for an answer without the expected format: reward = format_coef*(well_formed-1) + score.")
    group_size: int = documented(4, "Samples per problem (a group); advantages are centred within each group.")
    groups_per_batch: int = documented(8, "Problems (groups) per optimizer step.")
    # Sampling
    max_tokens: int = documented(64, "Sampling budget per turn.")
    temperature: float = documented(1.0, "Sampling temperature (> 0: the loss needs the sampler's logprobs of a real distribution).")
    # Loss
    loss_fn: LossName = documented("importance_sampling", "Policy-gradient loss computed by Tinker: importance_sampling, ppo, cispo, dro, gspo.")
    loss_fn_config: dict[str, float] = field(
        default_factory=dict,
        metadata={"doc": "Loss settings, e.g. {clip_low_threshold: 0.8, clip_high_threshold: 1.2} for ppo/cispo/gspo; dro needs {beta: ...}."},
    )
    num_substeps: int = documented(1, "forward_backward calls per step (gradients accumulate into one optim_step).")
    # Advantages
    scale_advantages_by_std: bool = documented(False, "Divide advantages by the group's reward std (off: it over-weights near-constant groups).")
    remove_constant_reward_groups: bool = documented(True, "Skip groups whose samples all got the same reward (zero advantage, no signal).")
    kl_penalty_coef: float = documented(0.0, "> 0: penalise divergence from kl_reference (a reference sampler), folded into the advantages.")
    kl_reference: KLReference = documented(
        "parent",
        "With kl_penalty_coef > 0, the policy the KL is measured from: parent (the checkpoint the run starts from; the base "
        "model when it starts from none) or base.",
    )
    kl_discount: float = documented(0.0, "Discount of the per-token KL penalty summed over later tokens (0 = per token only).")
    # Driver
    mode: Mode = documented("sync", "sync (sample then train), streaming (train minibatches as groups finish) or async (off-policy).")
    max_steps_off_policy: int = documented(1, "async: groups sampled by a policy more than this many steps old are stale.")
    stale_policy: StalePolicy = documented("drop", "async: drop stale groups, or requeue them to be sampled again.")

    def __post_init__(self) -> None:
        if isinstance(self.training, dict):
            self.training = TrainingConfig(**self.training)

    def problems(self) -> list[str]:
        found = [f"training.{problem}" for problem in self.training.problems()]
        if self.loss_fn not in LOSS_NAMES:
            found.append(f"loss_fn {self.loss_fn!r} is not one of {LOSS_NAMES}")
        if self.loss_fn == "dro" and "beta" not in self.loss_fn_config:
            found.append("loss_fn 'dro' needs loss_fn_config={'beta': <float>}")
        if self.mode not in MODES:
            found.append(f"mode {self.mode!r} is not one of {MODES}")
        if self.stale_policy not in STALE_POLICIES:
            found.append(f"stale_policy {self.stale_policy!r} is not one of {STALE_POLICIES}")
        for name in ("group_size", "groups_per_batch", "num_substeps", "max_tokens", "num_batches"):
            if getattr(self, name) < 1:
                found.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_substeps > self.groups_per_batch and self.mode == "streaming":
            found.append(f"num_substeps ({self.num_substeps}) must not exceed groups_per_batch ({self.groups_per_batch}) in streaming mode")
        if self.max_steps_off_policy < 0:
            found.append(f"max_steps_off_policy must be >= 0, got {self.max_steps_off_policy}")
        if self.kl_penalty_coef < 0:
            found.append(f"kl_penalty_coef must be >= 0, got {self.kl_penalty_coef}")
        if self.kl_reference not in KL_REFERENCES:
            found.append(f"kl_reference {self.kl_reference!r} is not one of {KL_REFERENCES}")
        if not 0.0 <= self.kl_discount < 1.0:
            found.append(f"kl_discount must be in [0, 1), got {self.kl_discount}")
        if self.temperature <= 0:
            found.append(f"temperature must be > 0 (RL needs the sampler's logprobs of a real distribution), got {self.temperature}")
        return found

    def validate(self) -> None:
        found = self.problems()
        if found:
            raise ValueError("invalid RLConfig: " + "; ".join(found))

    def identity(self) -> dict[str, Any]:
        """The fields that fix what step k trains on (the training part is checked by the core)."""
        values = asdict(self)
        values.pop("training")
        return values
