"""SFT on the platform: rendered tokens + base model → LoRA checkpoints (``sft_checkpoint``).

The asset is :func:`assets.training.build_training_asset` with SFT's spec: train on the ``train`` split of
``rendered_tokens`` with ``posttrain.supervised.SupervisedRecipe``, report held-out NLL/bpb in-loop. The eval
report scores held-out NLL and bits per byte of the exact token version trained on; ``best`` follows NLL.
"""


import dagster as dg
import pyarrow.compute as pc

from assets.evals import EvalInputs, EvalSpec, build_eval_asset
from assets.training import RecipeInputs, RecipeRun, TrainingSpec, build_checkpoints_asset, build_training_asset
from posttrain.datasets.schemas import HELDOUT_SPLIT, TRAIN_SPLIT
from posttrain.eval.nll import NllEvaluator
from posttrain.supervised.config import SupervisedConfig
from posttrain.supervised.data import RenderedTokens
from posttrain.supervised.recipe import SupervisedRecipe

TOKENS_ASSET = "rendered_tokens"
MAX_INLOOP_HELDOUT = 64  # held-out sequences scored at each in-loop evaluation


def build_sft(inputs: RecipeInputs) -> RecipeRun:
    tokens = inputs.tables[TOKENS_ASSET]
    heldout = RenderedTokens(tokens, split=HELDOUT_SPLIT)
    evaluators = [NllEvaluator(heldout.data_at(range(min(len(heldout), MAX_INLOOP_HELDOUT))))] if len(heldout) else []
    recipe = SupervisedRecipe(inputs.config, RenderedTokens(tokens, split=TRAIN_SPLIT), data_version=inputs.data_version(TOKENS_ASSET))
    return RecipeRun(recipe, evaluators=evaluators, renderer=str(inputs.versions[TOKENS_ASSET].metadata.get("renderer", "")))


SFT = TrainingSpec(
    recipe="sft",
    library_config=SupervisedConfig,
    ins={TOKENS_ASSET: dg.AssetIn()},
    build=build_sft,
    defaults={"learning_rate": 5e-4, "lora_rank": 16},
    description="LoRA SFT on the train split of rendered_tokens; every saved checkpoint becomes an `sft_checkpoints` partition.",
)
sft_checkpoint = build_training_asset(SFT)
sft_checkpoints = build_checkpoints_asset(SFT)


def sft_evaluators(inputs: EvalInputs) -> list:
    """Held-out NLL and bits per byte of the trained token version's held-out conversations, keyed by row id.

    Chat data has no verifiable answer: exact match against the reference reply says nothing about open-ended
    chat, so the report (and the ``best`` alias) follows NLL."""
    config = inputs.config
    table = inputs.tables[TOKENS_ASSET]
    heldout_rows = table.filter(pc.equal(table["split"], HELDOUT_SPLIT))
    heldout = RenderedTokens(heldout_rows)
    if len(heldout) == 0:
        raise dg.Failure(
            f"the {TOKENS_ASSET} version {inputs.manifest.partition} was trained on has no held-out conversations: "
            "materialize chat_dataset with heldout_fraction > 0, then rendered_tokens"
        )
    count = len(heldout) if not config.max_heldout_sequences else min(len(heldout), config.max_heldout_sequences)
    keys = heldout_rows["row_id"].to_pylist()[:count]
    return [NllEvaluator(heldout.data_at(range(count)), tokenizer=inputs.tokenizer, prefix="", keys=keys)]


SFT_EVAL = EvalSpec(training=SFT, data_assets=(TOKENS_ASSET,), evaluators=sft_evaluators, score_metric="nll")
sft_eval_report = build_eval_asset(SFT_EVAL)
