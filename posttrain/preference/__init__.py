"""Preference optimisation (DPO) over the tinker SDK, as a recipe on the training core.

Modules: ``dpo`` (the loss), ``data`` (pairs, validation, pair-preserving batches), ``reference``
(reference logprobs as an Arrow table), ``recipe`` (``DpoConfig``, ``DpoRecipe``), ``onpolicy``
(pairs from a checkpoint's graded samples), ``eval`` (held-out pair accuracy, win rate of A over B).
Entry points: ``train(config.training, DpoRecipe(config, pairs_table), service_client)`` (library,
``posttrain.training.core``) and ``python -m posttrain.preference.train --config JSON`` (plain script).
"""

from posttrain.preference.data import BadPairError, Pair, PairBatching, PreferencePairs, Side, pairs_from_table
from posttrain.preference.dpo import dpo_loss, dpo_loss_fn
from posttrain.preference.eval import PairAccuracyEvaluator, WinRate, WinRateEvaluator, compare_policies, win_rate_from_outcomes, win_rate_of
from posttrain.preference.onpolicy import OnPolicyPairs, accumulate_comparisons, build_onpolicy_pairs, samplers_in
from posttrain.preference.recipe import DpoConfig, DpoRecipe
from posttrain.preference.reference import REFERENCE_LOGPROBS, ReferenceSums, compute_reference_logprobs, reference_sampling_client

__all__ = [
    "REFERENCE_LOGPROBS",
    "BadPairError",
    "DpoConfig",
    "DpoRecipe",
    "OnPolicyPairs",
    "Pair",
    "PairAccuracyEvaluator",
    "PairBatching",
    "PreferencePairs",
    "ReferenceSums",
    "Side",
    "WinRate",
    "WinRateEvaluator",
    "accumulate_comparisons",
    "build_onpolicy_pairs",
    "compare_policies",
    "compute_reference_logprobs",
    "dpo_loss",
    "dpo_loss_fn",
    "pairs_from_table",
    "reference_sampling_client",
    "samplers_in",
    "win_rate_from_outcomes",
    "win_rate_of",
]
