"""RL with verifiable rewards on the platform: problems + a parent checkpoint → LoRA checkpoints (``rl_checkpoint``).

The asset is :func:`assets.training.build_training_asset` with RL's spec: by default it starts from the
newest SFT checkpoint (``latest:sft``) and trains ``posttrain.rl.RLRecipe`` on the ``train`` split of
``rl_problems``, each sample graded by its problem's own scorer. Other envs (``arithmetic``,
``guess_number``, ``reasoning_gym:<task>``, ``gsm8k``) generate or load their own problems; the table is
still recorded as an input, so lineage is complete either way. Every sample becomes a row of
``<log_dir>/rollouts.jsonl`` (committed with its checkpoint, exactly once across resumes), which
``rollout_batches`` (``assets.rollouts``) turns into a table. The eval report scores held-out greedy
accuracy and pass@k on the held-out problems of the exact ``rl_problems`` version trained on.
"""

from pathlib import Path

import dagster as dg

from assets.evals import EvalInputs, EvalSpec, build_eval_asset
from assets.problems import PROBLEMS_ASSET
from assets.training import RecipeInputs, RecipeRun, TrainingSpec, build_checkpoints_asset, build_training_asset
from posttrain.datasets.schemas import HELDOUT_SPLIT
from posttrain.eval.accuracy import AccuracyEvaluator, problems_from_table
from posttrain.eval.pass_at_k import PassAtKEvaluator
from posttrain.renderers import get_renderer
from posttrain.rl.config import RLConfig
from posttrain.rl.envs import build_rl_dataset
from posttrain.rl.recipe import RLRecipe
from posttrain.training.rows import JsonlRowSink
from resources.models import load_tokenizer

ROLLOUTS_FILE = "rollouts.jsonl"
TABLE_ENV = "problems"  # the env that trains on the rl_problems table


def build_rl(inputs: RecipeInputs) -> RecipeRun:
    config: RLConfig = inputs.config
    problems = config.problems()
    if problems:
        raise dg.Failure(f"rl_checkpoint config is invalid: {'; '.join(problems)}")
    if config.env == TABLE_ENV and config.env_options.get("split") == HELDOUT_SPLIT:
        raise dg.Failure(
            f"rl_checkpoint: env_options.split={HELDOUT_SPLIT!r} would train on the problems rl_eval_report holds out; "
            "train on 'train' (the default)"
        )
    tokenizer = load_tokenizer(inputs.base_model)
    try:
        renderer = get_renderer(config.renderer, tokenizer)
        dataset = build_rl_dataset(
            config.env,
            renderer,
            group_size=config.group_size,
            groups_per_batch=config.groups_per_batch,
            seed=config.training.seed,
            num_batches=config.num_batches,
            format_coef=config.format_coef,
            table=inputs.tables[PROBLEMS_ASSET] if config.env == TABLE_ENV else None,
            options=config.env_options,
        )
    except (ValueError, KeyError) as error:
        raise dg.Failure(
            f"rl_checkpoint: cannot build env={config.env!r} (env_options={config.env_options}, renderer={config.renderer!r}): {error}"
        ) from error
    return RecipeRun(
        RLRecipe(config, dataset, tokenizer),
        row_sinks=[JsonlRowSink(Path(inputs.log_dir) / ROLLOUTS_FILE)],
        related={"env": {"name": config.env, "options": dict(config.env_options), "problems_table": config.env == TABLE_ENV}},
        renderer=config.renderer,
    )


RL = TrainingSpec(
    recipe="rl",
    library_config=RLConfig,
    ins={PROBLEMS_ASSET: dg.AssetIn()},
    build=build_rl,
    parent_assets=("sft_checkpoint",),
    default_init_from="latest:sft",
    defaults={"env": TABLE_ENV, "save_every": 5, "learning_rate": 1e-4},
    description="RL with verifiable rewards (GRPO-style group advantages) from a parent checkpoint; every saved "
    "checkpoint becomes an `rl_checkpoints` partition and every sample a row of `rollout_batches`.",
)
rl_checkpoint = build_training_asset(RL)
rl_checkpoints = build_checkpoints_asset(RL)


def rl_evaluators(inputs: EvalInputs) -> list:
    """Greedy accuracy and pass@k (k = ``pass_k`` samples at temperature 1) on the trained version's held-out problems."""
    config = inputs.config
    problems = problems_from_table(inputs.tables[PROBLEMS_ASSET], split=HELDOUT_SPLIT, limit=config.max_problems or None)
    if not problems:
        raise dg.Failure(
            f"the {PROBLEMS_ASSET} version {inputs.manifest.partition} was trained on has no {HELDOUT_SPLIT!r} problems: "
            "materialize rl_problems with heldout_fraction > 0"
        )
    renderer = get_renderer(inputs.manifest.renderer or "chatml", inputs.tokenizer)
    evaluators = [AccuracyEvaluator(renderer, problems, prefix="", max_tokens=config.max_tokens, seed=config.seed)]
    if config.pass_k > 0:
        evaluators.append(PassAtKEvaluator(renderer, problems, config.pass_k, max_tokens=config.max_tokens, seed=config.seed))
    return evaluators


RL_EVAL = EvalSpec(training=RL, data_assets=(PROBLEMS_ASSET,), evaluators=rl_evaluators, score_metric="accuracy")
rl_eval_report = build_eval_asset(RL_EVAL)
