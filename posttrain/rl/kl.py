"""KL penalty against a reference policy, folded into the advantages (cookbook semantics).

For each sampled token t: d_t = (q_t − lp_ref_t)·mask_t, where q is the sampler's logprob and lp_ref the
reference model's (``compute_logprobs`` on the full sequence). d_t is a one-sample estimate of
KL(policy‖reference) at that token. The penalty is added to the advantages as
``coef·mask·(mean(d) − d_t)``: centred on the batch's mean over sampled tokens, so it moves probability
between tokens without shifting the overall advantage scale. With ``discount`` > 0 each token's penalty
also collects the discounted penalties of the tokens after it (γ-discounted future sum).

Also here: KL(sampler‖learner) and entropy estimates, which need only the datums and learner logprobs.
"""

from __future__ import annotations

import numpy as np
import tinker

from posttrain.rl.data import array_of, mask_of, with_advantages


def full_sequence(datum: tinker.Datum) -> tinker.ModelInput:
    """The datum's tokens before the shift: model_input plus the last target token."""
    last_target = int(datum.loss_fn_inputs["target_tokens"].to_numpy()[-1])
    return datum.model_input.append_int(last_target)


def discounted_future_sum(values: np.ndarray, discount: float) -> np.ndarray:
    """out[t] = Σ_{k≥t} discount^(k−t) · values[k]."""
    out = np.zeros_like(values, dtype=np.float64)
    running = 0.0
    for index in range(len(values) - 1, -1, -1):
        running = values[index] + discount * running
        out[index] = running
    return out


def reference_logprobs(reference: tinker.SamplingClient, datums: list[tinker.Datum]) -> list[np.ndarray]:
    """lp_ref for each target token of each datum (all requests submitted before any is awaited)."""
    futures = [reference.compute_logprobs(full_sequence(datum)) for datum in datums]
    return [np.asarray([0.0 if value is None else value for value in future.result()[1:]], dtype=np.float64) for future in futures]


def apply_kl_penalty(
    datums: list[tinker.Datum], reference_logprobs_D: list[np.ndarray], coef: float, discount: float = 0.0
) -> tuple[list[tinker.Datum], dict[str, float]]:
    """Datums with the penalty added to their advantages, and ``kl_policy_reference`` (mean d)."""
    if coef < 0:
        raise ValueError(f"kl_penalty_coef must be >= 0, got {coef}")
    if not 0.0 <= discount < 1.0:
        raise ValueError(f"kl_discount must be in [0, 1), got {discount}")
    masks = [mask_of(datum) for datum in datums]
    diffs = [(array_of(datum, "logprobs") - ref) * mask for datum, ref, mask in zip(datums, reference_logprobs_D, masks, strict=True)]
    total_tokens = sum(mask.sum() for mask in masks)
    mean_diff = float(sum(diff.sum() for diff in diffs) / total_tokens) if total_tokens else 0.0
    penalised = []
    for datum, diff, mask in zip(datums, diffs, masks):
        penalty = coef * mask * (mean_diff - diff)
        if discount > 0:
            penalty = discounted_future_sum(penalty, discount)
        penalised.append(with_advantages(datum, array_of(datum, "advantages") + penalty))
    return penalised, {"kl_policy_reference": mean_diff}


def sampler_learner_stats(datums: list[tinker.Datum], learner_logprobs_D: list[np.ndarray]) -> dict[str, float]:
    """Over sampled tokens: KL(sampler‖learner) estimates k1 = mean(q − lp) and k2 = ½·mean((q − lp)²),
    and the sampler's entropy estimate mean(−q). Non-zero KL on-policy means sampler and learner disagree
    (numerics, or weights that moved since sampling)."""
    masks = [mask_of(datum) for datum in datums]
    count = sum(mask.sum() for mask in masks)
    if not count:
        return {}
    sampler = [array_of(datum, "logprobs") for datum in datums]
    diffs = [(q - lp) * mask for q, lp, mask in zip(sampler, learner_logprobs_D, masks, strict=True)]
    return {
        "kl_sample_train_k1": float(sum(diff.sum() for diff in diffs) / count),
        "kl_sample_train_k2": float(sum((0.5 * diff * diff).sum() for diff in diffs) / count),
        "entropy": float(sum((-q * mask).sum() for q, mask in zip(sampler, masks)) / count),
    }
