"""RL with verifiable rewards on the platform: problems + a parent checkpoint → LoRA checkpoints (``rl_checkpoint``).

The asset is :func:`assets.training.build_training_asset` with RL's spec: by default it starts from the
newest SFT checkpoint (``latest:sft``) and trains ``posttrain.rl.RLRecipe`` on the ``train`` split of
``rl_problems`` and nothing else: every env (reasoning-gym tasks, GSM8K, arithmetic, guess-the-number
secrets, a user's file) is materialized there first (its source picks the env), and each row is played by
its env (``posttrain.rl.envs.instances``). Every sample becomes a row of
``<log_dir>/rollouts.jsonl`` (committed with its checkpoint, exactly once across resumes), which
``rollout_batches`` (``assets.rollouts``) turns into a table. The eval report plays the held-out rows of
the exact ``rl_problems`` version trained on: the env's own reward, greedy accuracy and pass@k.
"""

from pathlib import Path

import dagster as dg

from assets.evals import EvalInputs, EvalSpec, build_eval_asset
from assets.problems import PROBLEMS_ASSET
from assets.training import RecipeInputs, RecipeRun, TrainingSpec, build_checkpoints_asset, build_training_asset
from posttrain.datasets.problems import rl_problems_from_table
from posttrain.datasets.schemas import HELDOUT_SPLIT
from posttrain.renderers import get_renderer
from posttrain.rl.config import RLConfig
from posttrain.rl.envs import build_rl_dataset, check_env
from posttrain.rl.envs.problem_env import DEFAULT_FORMAT_COEF
from posttrain.rl.evaluation import EnvEvaluator
from posttrain.rl.recipe import RLRecipe
from posttrain.training.rows import JsonlRowSink
from resources.models import load_tokenizer

ROLLOUTS_FILE = "rollouts.jsonl"
TABLE_ENV = "problems"  # the env that trains on the rl_problems table


def side_loading_error(asset: str, env: str) -> str:
    """Why a recipe refuses an env other than the table's: unknown, or one that would generate or load its
    examples outside the asset graph."""
    try:
        check_env(env, {})
    except ValueError as error:
        return (f"{asset}: cannot build env={env!r}: {error}. Training assets take env={TABLE_ENV!r} only: materialize "
                f"another env's instances as rl_problems rows (source 'arithmetic?count=N', 'guess_number?count=N', gsm8k, "
                "'reasoning_gym:<task>', a file)")
    source = env.removeprefix("reasoning_gym:") if env.startswith("reasoning_gym:") else None
    example = f"reasoning_gym:{source}" if source else {"arithmetic": "arithmetic?count=400", "guess_number": "guess_number?count=400"}.get(env, env)
    return (
        f"{asset}: env={env!r} would generate or load its problems on the side, so the checkpoint's lineage could not "
        f"name them; materialize them as a table instead (rl_problems source={example!r}) and train with env={TABLE_ENV!r}"
    )


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
    if config.env != TABLE_ENV:
        raise dg.Failure(side_loading_error("rl_checkpoint", config.env))
    tokenizer = load_tokenizer(inputs.base_model)
    try:
        renderer = get_renderer(config.renderer, tokenizer, base_model=inputs.base_model)
        dataset = build_rl_dataset(
            TABLE_ENV,
            renderer,
            group_size=config.group_size,
            groups_per_batch=config.groups_per_batch,
            seed=config.training.seed,
            format_coef=config.format_coef,
            table=inputs.tables[PROBLEMS_ASSET],
            options=config.env_options,
        )
    except (ValueError, KeyError) as error:
        raise dg.Failure(
            f"rl_checkpoint: cannot build env={config.env!r} (env_options={config.env_options}, renderer={config.renderer!r}): {error}"
        ) from error
    try:
        recipe = RLRecipe(config, dataset, tokenizer, inputs.parent_sampler_path)
    except ValueError as error:
        raise dg.Failure(f"rl_checkpoint: {error}") from error
    return RecipeRun(
        recipe,
        row_sinks=[JsonlRowSink(Path(inputs.log_dir) / ROLLOUTS_FILE)],
        related={"env": {"name": TABLE_ENV, "options": dict(config.env_options), "problems_table": True,
                         "format_coef": config.format_coef}},
        renderer=renderer.name,
    )


RL = TrainingSpec(
    recipe="rl",
    library_config=RLConfig,
    ins={PROBLEMS_ASSET: dg.AssetIn()},
    build=build_rl,
    # Every checkpoint RL may start from, so the graph draws SFT → DPO → RL as a chain. Distillation is not
    # among them: its teachers may be RL checkpoints, and the graph cannot hold the cycle.
    parent_assets=("sft_checkpoint", "dpo_checkpoint"),
    default_init_from="latest:sft",
    defaults={"env": TABLE_ENV, "save_every": 5, "learning_rate": 1e-4},
    description="RL with verifiable rewards (GRPO-style group advantages) from a parent checkpoint; every saved "
    "checkpoint becomes an `rl_checkpoints` partition and every sample a row of `rollout_batches`.",
)
rl_checkpoint = build_training_asset(RL)
rl_checkpoints = build_checkpoints_asset(RL)


def rl_evaluators(inputs: EvalInputs) -> list:
    """The env's own reward, greedy accuracy and pass@k (k = ``pass_k`` plays at temperature 1) on the held-out
    rows of the exact ``rl_problems`` version trained on, each row played by the env that trains on it."""
    config, manifest = inputs.config, inputs.manifest
    problems = rl_problems_from_table(inputs.tables[PROBLEMS_ASSET], HELDOUT_SPLIT)[: config.max_problems or None]
    if not problems:
        raise dg.Failure(
            f"the {PROBLEMS_ASSET} version {manifest.partition} was trained on has no {HELDOUT_SPLIT!r} rows: "
            "materialize rl_problems with heldout_fraction > 0"
        )
    renderer = get_renderer(manifest.renderer or "chatml", inputs.tokenizer)
    format_coef = manifest.related.get("env", {}).get("format_coef", DEFAULT_FORMAT_COEF)
    return [EnvEvaluator(renderer, problems, k=config.pass_k, max_tokens=config.max_tokens, format_coef=format_coef, seed=config.seed)]


RL_EVAL = EvalSpec(training=RL, data_assets=(PROBLEMS_ASSET,), evaluators=rl_evaluators, score_metric="accuracy")
rl_eval_report = build_eval_asset(RL_EVAL)
