"""SFT on the platform: rendered tokens + base model → LoRA checkpoints (``sft_checkpoint``).

The asset is :func:`assets.training.build_training_asset` with SFT's spec: train on the ``train`` split of
``rendered_tokens`` with ``posttrain.supervised.SupervisedRecipe``, report held-out NLL/bpb in-loop.
"""


import dagster as dg

from assets.evals import EvalInputs, EvalSpec, build_eval_asset
from assets.training import RecipeInputs, RecipeRun, TrainingSpec, build_checkpoints_asset, build_training_asset
from posttrain.datasets.schemas import HELDOUT_SPLIT, TRAIN_SPLIT
from posttrain.datasets.tokens import get_renderer
from posttrain.eval.accuracy import AccuracyEvaluator
from posttrain.eval.chat_problems import problems_from_chat
from posttrain.eval.nll import NllEvaluator
from posttrain.supervised.config import SupervisedConfig
from posttrain.supervised.data import RenderedTokens
from posttrain.supervised.recipe import SupervisedRecipe

TOKENS_ASSET = "rendered_tokens"
CHAT_ASSET = "chat_dataset"
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
    """Held-out NLL/bpb on the trained token version, greedy task accuracy on its held-out conversations."""
    config = inputs.config
    heldout = RenderedTokens(inputs.tables[TOKENS_ASSET], split=HELDOUT_SPLIT)
    problems = problems_from_chat(inputs.tables[CHAT_ASSET], config.max_problems)
    if len(heldout) == 0 or not problems:
        raise dg.Failure(
            f"no held-out data in the versions {inputs.manifest.partition} was trained on: {len(heldout)} token rows, "
            f"{len(problems)} conversations; materialize the data with heldout_fraction > 0"
        )
    count = len(heldout) if not config.max_heldout_sequences else min(len(heldout), config.max_heldout_sequences)
    renderer = get_renderer(inputs.manifest.renderer or "chatml", inputs.tokenizer)
    return [
        NllEvaluator(heldout.data_at(range(count)), tokenizer=inputs.tokenizer, prefix=""),
        AccuracyEvaluator(renderer, problems, prefix="", max_tokens=config.max_tokens, seed=config.seed),
    ]


SFT_EVAL = EvalSpec(training=SFT, data_assets=(TOKENS_ASSET, CHAT_ASSET), evaluators=sft_evaluators)
sft_eval_report = build_eval_asset(SFT_EVAL)
