"""The Dagster code location: assets, jobs, automation, schedules and the resources chosen for this environment.

Resources are chosen in one place (:func:`default_resources`) from the environment:
- ``TINKER_API_KEY`` set → hosted Tinker (the key is read through ``dg.EnvVar``, never stored in config);
  otherwise an embedded localtinker, or the server at ``TINKER_BASE_URL`` when that is set;
- ``POSTTRAIN_BASE_MODEL`` (default SmolLM2-135M-Instruct) and ``LOCALTINKER_DTYPE`` (default float32: exact, and the fastest on CPUs without AMX);
- MLflow and parquet storage under the absolute project state dir (``POSTTRAIN_STATE_DIR``, default
  ``<repo>/.state``).
Tests build their own with :func:`build_definitions`.

Each recipe contributes a training asset, its ``<recipe>_checkpoints`` partitions asset, its eval report
and its jobs (``pipelines.recipes``); the automation sensor evaluates every new checkpoint once.
"""

import os

import dagster as dg

from assets.code_rl import CODE_RL_EVAL, code_rl_checkpoint, code_rl_checkpoints, code_rl_eval_report
from assets.data_assets import DATA_ASSETS
from assets.distill import DISTILL_ASSETS, DISTILL_DATA_ASSETS, DISTILL_EVAL, PROMPT_DISTILL_DATA_ASSETS, PROMPT_DISTILL_EVAL
from assets.dpo import DPO_ASSETS, DPO_DATA_ASSETS, DPO_EVAL, DPO_OFFLINE_DATA_ASSETS, DPO_OFFLINE_DEFAULTS
from assets.preference_model import PREFERENCE_MODEL_ASSETS, PREFERENCE_MODEL_DATA_ASSETS, PREFERENCE_MODEL_EVAL
from assets.rl import RL_EVAL, rl_checkpoint, rl_checkpoints, rl_eval_report
from assets.rlhf import RLHF_ASSETS, RLHF_DATA_ASSETS, RLHF_EVAL
from assets.rollouts import rollout_batches
from assets.sft import SFT_EVAL, sft_checkpoint, sft_checkpoints, sft_eval_report
from pipelines.benchmarks import benchmark_definitions
from pipelines.exports import export_definitions, export_format_from_env
from pipelines.recipes import ChainVariant, build_recipe_jobs, whole_op_defaults
from resources.mlflow import MlflowResource
from resources.mlflow_links import mlflow_ui_url
from resources.parquet_io import ParquetIOManager
from resources.state import state_subdir
from resources.tinker import DEFAULT_BASE_MODEL, TinkerResource

SFT_DATA_ASSETS = ("base_model", "chat_dataset", "rendered_tokens")
RL_DATA_ASSETS = ("base_model", "rl_problems")
CODE_RL_DATA_ASSETS = ("base_model", "code_problems")
AUTOMATION_SENSOR = "evaluate_new_checkpoints"


def tinker_resource_from_env() -> TinkerResource:
    """Hosted when a key is exported, else local; EnvVar keeps the key and URL out of run config."""
    return TinkerResource(
        api_key=dg.EnvVar("TINKER_API_KEY") if os.environ.get("TINKER_API_KEY") else None,
        base_url=dg.EnvVar("TINKER_BASE_URL") if os.environ.get("TINKER_BASE_URL") else None,
        base_model=os.environ.get("POSTTRAIN_BASE_MODEL", DEFAULT_BASE_MODEL),
        local_dtype=os.environ.get("LOCALTINKER_DTYPE", "auto"),  # bf16 on a GPU from sm80, else float32
    )


def default_resources() -> dict:
    return {
        "tinker": tinker_resource_from_env(),
        "mlflow": MlflowResource(
            ui_url=mlflow_ui_url(),
            best_follows=os.environ.get("POSTTRAIN_BEST_FOLLOWS") or None,  # a benchmark name: `best` follows it
        ),
        "io_manager": ParquetIOManager(base_dir=str(state_subdir("parquet"))),
    }


def automation_sensor() -> dg.AutomationConditionSensorDefinition:
    """Runs every eval report's ``on_missing`` condition: each new checkpoint partition is evaluated once."""
    return dg.AutomationConditionSensorDefinition(
        AUTOMATION_SENSOR,
        target=dg.AssetSelection.groups("eval"),
        default_status=dg.DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=30,
        description="Evaluates every new checkpoint partition once (the eval reports' on_missing condition).",
    )


def build_definitions(resources: dict) -> dg.Definitions:
    recipes = [
        build_recipe_jobs(SFT_EVAL, SFT_DATA_ASSETS),
        build_recipe_jobs(RL_EVAL, RL_DATA_ASSETS, outputs=("rollout_batches",)),
        build_recipe_jobs(CODE_RL_EVAL, CODE_RL_DATA_ASSETS),
        build_recipe_jobs(DISTILL_EVAL, DISTILL_DATA_ASSETS),
        build_recipe_jobs(PROMPT_DISTILL_EVAL, PROMPT_DISTILL_DATA_ASSETS),
        build_recipe_jobs(DPO_EVAL, DPO_DATA_ASSETS, variants=[
            ChainVariant("offline", DPO_OFFLINE_DATA_ASSETS, whole_op_defaults(DPO_ASSETS, DPO_OFFLINE_DEFAULTS),
                         "offline comparisons (preference_comparisons: HH-RLHF, UltraFeedback, a file) → pairs → reference "
                         "logprobs of the base model → DPO from the base model, in one run"),
        ]),
        build_recipe_jobs(PREFERENCE_MODEL_EVAL, PREFERENCE_MODEL_DATA_ASSETS),
        build_recipe_jobs(RLHF_EVAL, RLHF_DATA_ASSETS, outputs=("rlhf_rollout_batches",)),
    ]
    recipe_definitions = dg.Definitions(
        assets=[*DATA_ASSETS, sft_checkpoint, sft_checkpoints, sft_eval_report,
                rl_checkpoint, rl_checkpoints, rl_eval_report, rollout_batches,
                code_rl_checkpoint, code_rl_checkpoints, code_rl_eval_report, *DISTILL_ASSETS, *DPO_ASSETS,
                *PREFERENCE_MODEL_ASSETS, *RLHF_ASSETS],
        jobs=[job for recipe in recipes for job in recipe.jobs],
        sensors=[automation_sensor()],
        schedules=[recipe.schedule for recipe in recipes],
        resources=resources,
    )
    exports = export_definitions([spec.training for spec in (
        SFT_EVAL, RL_EVAL, CODE_RL_EVAL, DISTILL_EVAL, PROMPT_DISTILL_EVAL, DPO_EVAL, PREFERENCE_MODEL_EVAL, RLHF_EVAL)], export_format_from_env())
    return dg.Definitions.merge(recipe_definitions, benchmark_definitions(), exports)


defs = build_definitions(default_resources())
