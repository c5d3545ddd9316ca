"""Code RL on the platform: code problems + sandbox → LoRA checkpoints (``code_rl_checkpoint``).

The asset is :func:`assets.training.build_training_asset` with code RL's spec: ``posttrain.rl.RLRecipe``
on the ``code`` env (``posttrain.rl.envs.code_env``) over the ``train`` split of ``code_problems``; each
sampled program runs against its hidden tests in the sandbox (a group's programs concurrently), reward
``0.1·(has_code_block − 1) + all_tests_pass``. It starts from the base model by default: SmolLM2-135M-
Instruct already answers in ```python blocks and solves some easy tasks, which is all GRPO needs (a
group whose answers all score the same teaches nothing); ``init_from=latest:sft`` chains it after SFT.

Every sample is a row of ``<log_dir>/rollouts.jsonl`` with its reward, advantage, ``sandbox_status``
(passed / failed / timeout / crashed / sandbox_error / no_code_block) and ``test_output`` (the tail of
what the tests printed), committed with its checkpoint exactly once across resumes.

``code_rl_eval_report`` scores each checkpoint, its base model and its parent with greedy ``pass@1`` and
sampled ``pass@k`` (``posttrain.eval.code_pass``, every program run in the sandbox) on the held-out problems
of the exact ``code_problems`` version trained on (capped by ``max_problems``), and on nothing else: the
report is about the data the checkpoint learned from. HumanEval as a benchmark of any checkpoint is the
``benchmark_result`` asset's (``pipelines.benchmarks``); to train on it, materialize ``code_problems``
with ``source="human_eval"``.
"""

from pathlib import Path

import dagster as dg

from assets.evals import EvalInputs, EvalSpec, build_eval_asset
from assets.problems import CODE_PROBLEMS_ASSET
from assets.rl import ROLLOUTS_FILE
from assets.training import RecipeInputs, RecipeRun, TrainingSpec, build_checkpoints_asset, build_training_asset
from posttrain.datasets.problems import code_problems_from_table
from posttrain.datasets.schemas import HELDOUT_SPLIT
from posttrain.eval.code_pass import CodePassEvaluator
from posttrain.renderers import get_renderer
from posttrain.rl.config import RLConfig
from posttrain.rl.envs import build_rl_dataset
from posttrain.rl.recipe import RLRecipe
from posttrain.training.rows import JsonlRowSink
from resources.models import load_tokenizer

CODE_ENV = "code"
# Sampling budget per answer: an easy task's function is ~30 tokens, a HumanEval-sized one a few hundred.
TRAIN_MAX_TOKENS = 96
EVAL_MAX_TOKENS = 160


def build_code_rl(inputs: RecipeInputs) -> RecipeRun:
    config: RLConfig = inputs.config
    problems = config.problems()
    if config.env != CODE_ENV:
        problems.append(f"env must be {CODE_ENV!r} (code RL trains on the code_problems table), got {config.env!r}; use rl_checkpoint for other envs")
    if problems:
        raise dg.Failure(f"code_rl_checkpoint config is invalid: {'; '.join(problems)}")
    tokenizer = load_tokenizer(inputs.base_model)
    try:
        renderer = get_renderer(config.renderer, tokenizer, base_model=inputs.base_model)
        dataset = build_rl_dataset(
            CODE_ENV,
            renderer,
            group_size=config.group_size,
            groups_per_batch=config.groups_per_batch,
            seed=config.training.seed,
            format_coef=config.format_coef,
            table=inputs.tables[CODE_PROBLEMS_ASSET],
            options=config.env_options,
        )
    except (ValueError, KeyError) as error:
        raise dg.Failure(
            f"code_rl_checkpoint: cannot build the code env from {CODE_PROBLEMS_ASSET} "
            f"(env_options={config.env_options}, renderer={config.renderer!r}): {error}"
        ) from error
    try:
        recipe = RLRecipe(config, dataset, tokenizer, inputs.parent_sampler_path)
    except ValueError as error:
        raise dg.Failure(f"code_rl_checkpoint: {error}") from error
    return RecipeRun(
        recipe,
        row_sinks=[JsonlRowSink(Path(inputs.log_dir) / ROLLOUTS_FILE)],
        related={"env": {"name": CODE_ENV, "options": dict(config.env_options), "problems_table": True}},
        renderer=renderer.name,
    )


CODE_RL = TrainingSpec(
    recipe="code_rl",
    library_config=RLConfig,
    ins={CODE_PROBLEMS_ASSET: dg.AssetIn()},
    build=build_code_rl,
    parent_assets=("sft_checkpoint", "dpo_checkpoint", "rl_checkpoint", "distill_checkpoint", "prompt_distill_checkpoint"),
    default_init_from="",
    # Defaults that measurably lift SmolLM2-135M-Instruct's held-out pass@1 in minutes (docs/benchmarks.md, code RL).
    defaults={
        "env": CODE_ENV,
        "group_size": 4,
        "groups_per_batch": 4,
        "max_tokens": TRAIN_MAX_TOKENS,
        "learning_rate": 4e-4,
        "lr_schedule": "constant",
        "lora_rank": 16,
        "save_every": 4,
        "max_steps": 16,
    },
    description="Code RL (GRPO-style group advantages, programs graded by their tests in the sandbox); every saved "
    "checkpoint becomes a `code_rl_checkpoints` partition.",
)
code_rl_checkpoint = build_training_asset(CODE_RL)
code_rl_checkpoints = build_checkpoints_asset(CODE_RL)


def code_rl_evaluators(inputs: EvalInputs) -> list[CodePassEvaluator]:
    """Greedy pass@1 and sampled pass@k on the held-out problems of the code_problems version trained on."""
    config = inputs.config
    limit = config.max_problems or None
    heldout = code_problems_from_table(inputs.tables[CODE_PROBLEMS_ASSET], HELDOUT_SPLIT)[:limit]
    if not heldout:
        raise dg.Failure(
            f"the {CODE_PROBLEMS_ASSET} version {inputs.manifest.partition} was trained on has no {HELDOUT_SPLIT!r} problems: "
            "materialize code_problems with heldout_fraction > 0"
        )
    renderer = get_renderer(inputs.manifest.renderer or "chatml", inputs.tokenizer)
    return [CodePassEvaluator(renderer, heldout, k=config.pass_k, max_tokens=config.max_tokens, seed=config.seed)]


CODE_RL_EVAL = EvalSpec(
    training=CODE_RL,
    data_assets=(CODE_PROBLEMS_ASSET,),
    evaluators=code_rl_evaluators,
    score_metric="accuracy",  # greedy pass rate on the held-out generated tasks
    config_defaults={"max_tokens": EVAL_MAX_TOKENS},
)
code_rl_eval_report = build_eval_asset(CODE_RL_EVAL)
