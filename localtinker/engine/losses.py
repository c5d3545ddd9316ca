"""Tinker's built-in losses, per token, summed over tokens and datums (ARCHITECTURE §4).

lp = learner logprobs of ``target_tokens``; q = sampler ``logprobs``; A = ``advantages``;
w = ``weights``; r = exp(lp − q). Every function returns the *elementwise* loss [T] of one datum;
the engine sums it (never averages). RL losses ignore ``weights``: the client masks by zeroing A.
The formulas and config keys are Tinker's documented ones (tinker-docs.thinkingmachines.ai/tinker/losses).
``stable_reinforce`` (in the SDK's LossFnType) has no published formula, so it is refused.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable

import torch

from localtinker.engine.api import SUPPORTED_LOSSES, EngineUserError

LossInputs = dict[str, torch.Tensor]
# The engine runs a loss once over a micro-batch's datums laid end to end (one kernel per operation, not one per
# datum); for that call this input holds each token's datum index, 0, 1, ... in order (int64 [T]). Only GSPO,
# whose ratio is a mean over each sequence, reads it.
DATUM_OF_TOKEN = "_datum_of_token"

CONFIG_DEFAULTS: dict[str, dict[str, float | None]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": None},  # None = required
    # Ratio bounds around the sequence ratio; defaults are the GSPO paper's (1 − 3e-4, 1 + 4e-4).
    "gspo": {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
}

FLOAT_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages", "sequence_ratio_mask"),
}


def resolve_loss_config(loss_fn: str, config: dict[str, float] | None) -> dict[str, float]:
    """Checks the loss name and its config; returns the config with defaults filled in."""
    if loss_fn not in CONFIG_DEFAULTS:
        raise EngineUserError(
            f"loss_fn {loss_fn!r} is not supported; use one of {', '.join(SUPPORTED_LOSSES)} "
            "(or forward_backward_custom for anything else)."
        )
    defaults = CONFIG_DEFAULTS[loss_fn]
    given = dict(config or {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        accepted = ", ".join(defaults) or "none"
        raise EngineUserError(f"loss_fn_config keys {unknown} are not used by {loss_fn!r} (accepted: {accepted}).")
    resolved: dict[str, float] = {}
    for key, default in defaults.items():
        value = given.get(key, default)
        if value is None:
            raise EngineUserError(f"loss {loss_fn!r} needs loss_fn_config[{key!r}] (a non-negative number).")
        if not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
            raise EngineUserError(f"loss_fn_config[{key!r}] must be a finite number >= 0, got {value!r}.")
        resolved[key] = float(value)
    if "clip_low_threshold" in resolved and resolved["clip_low_threshold"] > resolved["clip_high_threshold"]:
        raise EngineUserError(
            f"clip_low_threshold ({resolved['clip_low_threshold']}) must not exceed clip_high_threshold "
            f"({resolved['clip_high_threshold']})."
        )
    return resolved


def cross_entropy(lp: torch.Tensor, inputs: LossInputs, config: dict[str, float]) -> torch.Tensor:
    return -inputs["weights"] * lp


def importance_sampling(lp: torch.Tensor, inputs: LossInputs, config: dict[str, float]) -> torch.Tensor:
    ratio = torch.exp(lp - inputs["logprobs"])
    return -ratio * inputs["advantages"]


def ppo(lp: torch.Tensor, inputs: LossInputs, config: dict[str, float]) -> torch.Tensor:
    advantages = inputs["advantages"]
    ratio = torch.exp(lp - inputs["logprobs"])
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages)


def cispo(lp: torch.Tensor, inputs: LossInputs, config: dict[str, float]) -> torch.Tensor:
    ratio = torch.exp(lp - inputs["logprobs"])
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"]).detach()
    return -clipped * lp * inputs["advantages"]


def dro(lp: torch.Tensor, inputs: LossInputs, config: dict[str, float]) -> torch.Tensor:
    deviation = lp - inputs["logprobs"]
    return -(lp * inputs["advantages"] - 0.5 * config["beta"] * deviation * deviation)


def gspo(lp: torch.Tensor, inputs: LossInputs, config: dict[str, float]) -> torch.Tensor:
    """GSPO-token: every token carries its sequence's ratio s = exp(mean over the mask of lp − q) as its
    value, with the gradient of its own lp (s_t = sg(s)·exp(lp_t − sg(lp_t))), clipped like PPO. Over several
    datums laid end to end, ``inputs[DATUM_OF_TOKEN]`` says which datum (sequence) each token belongs to."""
    in_ratio = (inputs["sequence_ratio_mask"] != 0).to(lp.dtype)
    deviation = (lp.detach() - inputs["logprobs"]) * in_ratio
    datum = inputs.get(DATUM_OF_TOKEN)
    if datum is None:
        sequence_log_ratio = deviation.sum() / in_ratio.sum()
    else:
        slots = len(datum)  # at least one token per datum: enough slots, with no count read back from the device
        sums = lp.new_zeros(slots).index_add_(0, datum, deviation)
        sequence_log_ratio = (sums / lp.new_zeros(slots).index_add_(0, datum, in_ratio))[datum]
    ratio = torch.exp(sequence_log_ratio + lp - lp.detach())
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    advantages = inputs["advantages"]
    return -torch.minimum(ratio * advantages, clipped * advantages)


def gradient_tokens(loss_fn: str, inputs: LossInputs, config: dict[str, float]) -> torch.Tensor:
    """bool [T]: the tokens whose logprob can get a non-zero gradient from ``loss_fn``; every other token's
    gradient is exactly zero (a zero weight or advantage multiplies it), so the trainer skips its share of
    the unembedding's backward (see ``logprobs.token_logprobs_tracking``): a chat SFT prompt, an RL
    observation, the prompt of a DPO pair. DRO's quadratic term reaches every token while ``beta`` > 0."""
    if loss_fn == "cross_entropy":
        return inputs["weights"] != 0
    if loss_fn == "dro" and config["beta"] != 0:
        return torch.ones_like(inputs["advantages"], dtype=torch.bool)
    return inputs["advantages"] != 0


LOSSES: dict[str, Callable[[torch.Tensor, LossInputs, dict[str, float]], torch.Tensor]] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
}
