"""The preference model on the platform: comparisons → a judge checkpoint (``preference_model_checkpoint``).

The asset is :func:`assets.training.build_training_asset` with the preference model's spec: supervised
learning (``posttrain.preference.rlhf.PreferenceModelRecipe``) on the ``train`` split of the comparisons
table chosen in the launchpad (``comparisons``), rendered in the cookbook's pairwise format
(``posttrain.preference.comparison_format``) and trained on the label token. ``onpolicy_comparisons``
(the default: a correct and a wrong answer of one prompt, sampled from the SFT checkpoint and graded by
the task's verifier) or ``preference_comparisons`` (hub data by preset: ``hh_rlhf``, ``ultrafeedback``,
``helpsteer3``, or a file). It starts from the newest SFT checkpoint by default (empty ``init_from`` = the
base model). The manifest records the comparisons table and version (``related.comparisons``), which the
RLHF checkpoints it judges name in turn.

With ``reference: chosen`` the judge is trained with the chosen (verified) completion as a reference answer
before the pair, and writes its own answer there when it judges (``posttrain.preference.comparison_format``).

``preference_model_eval_report``: held-out comparison accuracy on the exact comparisons version trained
on (both orders averaged), accuracy in each order alone, agreement across orders and position bias; a
judge with references is scored with its own answers, as RLHF uses it.
"""

import dagster as dg

from assets.evals import EvalInputs, EvalSpec, build_eval_asset
from assets.training import RecipeInputs, RecipeRun, TrainingSpec, build_checkpoints_asset, build_training_asset
from posttrain.datasets.schemas import HELDOUT_SPLIT, TRAIN_SPLIT
from posttrain.preference.comparison_eval import PreferenceAccuracyEvaluator
from posttrain.preference.comparison_format import ComparisonRenderer, labeled_comparisons_from_table
from posttrain.preference.rlhf import PreferenceModelConfig, PreferenceModelRecipe
from posttrain.renderers import get_renderer
from resources.models import load_tokenizer

RECIPE = "preference_model"
COMPARISON_ASSETS = ("onpolicy_comparisons", "preference_comparisons")  # the launchpad's `comparisons` choice
VERIFIED_COMPARISONS = "onpolicy_comparisons"  # its chosen side is a verifier-graded correct answer
MAX_INLOOP_HELDOUT = 64  # held-out comparisons judged at each in-loop evaluation


def heldout_comparisons(table, limit: int | None = None) -> list:
    """Held-out comparisons with the chosen completion first (the evaluator judges both orders)."""
    comparisons = [labeled.comparison for labeled in labeled_comparisons_from_table(table, HELDOUT_SPLIT, orders="both") if labeled.label == "A"]
    return comparisons[:limit] if limit else comparisons


def build_preference_model(inputs: RecipeInputs) -> RecipeRun:
    config: PreferenceModelConfig = inputs.config
    asset = inputs.launch_config.comparisons
    version = inputs.versions[asset]
    table = inputs.tables[asset]
    renderer = ComparisonRenderer(get_renderer(config.renderer, load_tokenizer(inputs.base_model)))
    if config.reference == "chosen" and asset != VERIFIED_COMPARISONS:
        raise dg.Failure(
            f"{RECIPE}_checkpoint: reference=chosen trains the judge to trust the chosen completion as a correct answer, but "
            f"{asset} holds preferences, not verified answers: pick comparisons={VERIFIED_COMPARISONS} or reference=none"
        )
    try:
        train_split = labeled_comparisons_from_table(
            table, TRAIN_SPLIT, orders=config.orders, seed=config.training.seed, reference=config.reference
        )
        recipe = PreferenceModelRecipe(config, train_split, renderer, data_version=version.data_version)
    except ValueError as error:
        raise dg.Failure(
            f"{RECIPE}_checkpoint: {asset} {version.data_version} (run {version.run_id}, {table.num_rows} rows): {error}; "
            f"materialize {asset} with train rows, or pick the other comparisons table"
        ) from error
    heldout = heldout_comparisons(table, MAX_INLOOP_HELDOUT)
    return RecipeRun(
        recipe,
        evaluators=[PreferenceAccuracyEvaluator(heldout, renderer, answers_first=config.reference == "chosen")] if heldout else [],
        related={"comparisons": {"asset": asset, "data_version": version.data_version, "orders": config.orders,
                                 "reference": config.reference, "num_train": len(train_split)}},
        renderer=config.renderer,
    )


PREFERENCE_MODEL = TrainingSpec(
    recipe=RECIPE,
    library_config=PreferenceModelConfig,
    ins={},
    build=build_preference_model,
    parent_assets=("sft_checkpoint",),
    default_init_from="latest:sft",
    # docs/rlhf.md: 24 steps at 1e-3 took the label loss 3.7 -> 0.56 nats; 12 steps at 2e-4 left it at 2.5 (a chance judge).
    defaults={"learning_rate": 1e-3, "lora_rank": 16, "batch_size": 8, "save_every": 20},
    input_choice=("comparisons", COMPARISON_ASSETS),
    description="A preference model: SFT on comparisons in the cookbook's pairwise format (label A/B/Tie), from the newest SFT "
    "checkpoint by default; every saved checkpoint becomes a `preference_model_checkpoints` partition.",
)
preference_model_checkpoint = build_training_asset(PREFERENCE_MODEL)
preference_model_checkpoints = build_checkpoints_asset(PREFERENCE_MODEL)


def preference_model_evaluators(inputs: EvalInputs) -> list:
    manifest = inputs.manifest
    recorded = manifest.related.get("comparisons") or {}
    if "asset" not in recorded:
        raise dg.Failure(f"checkpoint {manifest.partition} records no comparisons table; it is not a preference-model checkpoint")
    heldout = heldout_comparisons(inputs.tables[recorded["asset"]], inputs.config.max_heldout_sequences or None)
    if not heldout:
        raise dg.Failure(
            f"the {recorded['asset']} version {recorded.get('data_version')} that {manifest.partition} was trained on has no "
            f"{HELDOUT_SPLIT!r} rows: materialize it with heldout_fraction > 0"
        )
    renderer = ComparisonRenderer(get_renderer(manifest.renderer or "chatml", inputs.tokenizer))
    answers_first = judge_answers_first(recorded)
    return [PreferenceAccuracyEvaluator(heldout, renderer, prefix="", answers_first=answers_first, answer_max_tokens=inputs.config.max_tokens)]


def judge_answers_first(comparisons: dict) -> bool:
    """Whether a preference model, by its manifest's ``related.comparisons``, was trained with reference answers
    and so writes its own answer before it judges."""
    return comparisons.get("reference") == "chosen"


PREFERENCE_MODEL_EVAL = EvalSpec(
    training=PREFERENCE_MODEL, data_assets=COMPARISON_ASSETS, evaluators=preference_model_evaluators, score_metric="comparison_accuracy"
)
preference_model_eval_report = build_eval_asset(PREFERENCE_MODEL_EVAL)

PREFERENCE_MODEL_DATA_ASSETS = ("base_model", "rl_problems", "onpolicy_comparisons")
PREFERENCE_MODEL_ASSETS = (preference_model_checkpoint, preference_model_checkpoints, preference_model_eval_report)
