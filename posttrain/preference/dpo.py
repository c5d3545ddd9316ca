"""The DPO loss on per-token logprobs (Rafailov et al. 2023, sigmoid form; tinker-cookbook semantics).

A pair's sequence logprob is the *raw* weighted token sum ``Σ w·lp`` over its completion (no length
normalisation: DPO's implicit reward is a log-ratio of sequence probabilities). With the reference
model's sums ``ref``, the implicit reward of a side is ``β·(lp − ref)``, and

    loss = mean over pairs of −logsigmoid(β·((lp_c − ref_c) − (lp_r − ref_r)))

so a freshly initialised policy (lp = ref) has loss ln 2 whatever the data. Metrics (means over pairs):
``dpo_loss``, ``accuracy`` (fraction of pairs whose chosen side's log-ratio beats the rejected one's by more
than :data:`TIE_NATS`, a tie counting ½ — a policy that cannot tell the sides apart is at chance, not wrong; ties are
float noise: the same weights scored by two code paths, a sampler's and a trainer's,
differ by ~1e-5 per token, so a policy equal to its reference would otherwise rank pairs at random),
``margin`` (chosen − rejected reward), ``chosen_reward``, ``rejected_reward``.

:func:`dpo_loss_fn` packages this as the ``loss_fn`` of ``TrainingClient.forward_backward_custom``: the
SDK gives it the batch's datums and one logprob tensor per datum, with datum ``2i`` the chosen and
``2i + 1`` the rejected side of pair ``i`` (the layout ``posttrain.preference.data`` builds).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

import tinker
import torch
import torch.nn.functional as F

# A log-ratio gap (chosen − rejected, before β) at most this large is a tie, not a correct ranking.
TIE_NATS = 1e-3

DpoLossFn = Callable[[list[tinker.Datum], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


def pair_credit(margin_P: torch.Tensor, beta: float) -> torch.Tensor:
    """Per pair: 1 if the chosen side wins by more than a tie, ½ for a tie (chance), 0 if it loses."""
    tie = beta * TIE_NATS
    margin_P = margin_P.to(torch.float64)
    return (margin_P > tie).to(torch.float64) + 0.5 * (margin_P.abs() <= tie).to(torch.float64)


def weighted_logprob_sum(logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``Σ w·lp`` of one sequence, in float64 so long completions do not lose the small differences."""
    if logprobs.shape != weights.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and weights {tuple(weights.shape)} must have the same shape")
    return (logprobs.to(torch.float64) * weights.to(torch.float64)).sum()


def dpo_loss(
    chosen_logprob_P: torch.Tensor,
    rejected_logprob_P: torch.Tensor,
    chosen_ref_logprob_P: torch.Tensor,
    rejected_ref_logprob_P: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean sigmoid-DPO loss over ``P`` pairs of sequence logprobs, and its metrics."""
    if not beta > 0:
        raise ValueError(f"DPO beta must be positive, got {beta}")
    if chosen_logprob_P.numel() == 0:
        raise ValueError("dpo_loss got no pairs")
    chosen_reward_P = beta * (chosen_logprob_P - chosen_ref_logprob_P.to(chosen_logprob_P.dtype))
    rejected_reward_P = beta * (rejected_logprob_P - rejected_ref_logprob_P.to(rejected_logprob_P.dtype))
    margin_P = chosen_reward_P - rejected_reward_P
    loss = -F.logsigmoid(margin_P).mean()
    metrics = {
        "dpo_loss": float(loss.detach()),
        "accuracy": float(pair_credit(margin_P.detach(), beta).mean()),
        "margin": float(margin_P.detach().mean()),
        "chosen_reward": float(chosen_reward_P.detach().mean()),
        "rejected_reward": float(rejected_reward_P.detach().mean()),
    }
    return loss, metrics


def dpo_loss_fn(chosen_ref_logprob_P: Sequence[float], rejected_ref_logprob_P: Sequence[float], beta: float) -> DpoLossFn:
    """A ``forward_backward_custom`` loss for one batch whose reference sums are given per pair.

    The datums' ``weights`` select (and weigh) the completion tokens; they must be the same weights
    the reference sums were computed with.
    """
    chosen_ref = torch.as_tensor(list(chosen_ref_logprob_P), dtype=torch.float64)
    rejected_ref = torch.as_tensor(list(rejected_ref_logprob_P), dtype=torch.float64)
    if chosen_ref.shape != rejected_ref.shape:
        raise ValueError(f"{len(chosen_ref)} chosen but {len(rejected_ref)} rejected reference sums")

    def loss_fn(data: list[tinker.Datum], logprobs_D: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        if len(data) != 2 * len(chosen_ref) or len(logprobs_D) != len(data):
            raise ValueError(
                f"the DPO loss expects {2 * len(chosen_ref)} datums (chosen, rejected per pair) and as many logprob "
                f"tensors, got {len(data)} datums and {len(logprobs_D)} tensors: build batches with "
                "posttrain.preference.data"
            )
        sums_D = [
            weighted_logprob_sum(logprobs.reshape(-1), datum.loss_fn_inputs["weights"].to_torch().reshape(-1))
            for datum, logprobs in zip(data, logprobs_D)
        ]
        return dpo_loss(torch.stack(sums_D[0::2]), torch.stack(sums_D[1::2]), chosen_ref, rejected_ref, beta)

    return loss_fn
