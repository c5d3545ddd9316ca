"""The Dagster code location: assets, jobs, sensors, schedules and the resources chosen for this environment.

Resources are chosen in one place (:func:`default_resources`) from the environment:
- ``TINKER_API_KEY`` set → hosted Tinker (the key is read through ``dg.EnvVar``, never stored in config);
  otherwise an embedded localtinker, or the server at ``TINKER_BASE_URL`` when that is set;
- ``POSTTRAIN_BASE_MODEL`` (default SmolLM2-135M-Instruct) and ``LOCALTINKER_DTYPE`` (default float32: exact, and the fastest on CPUs without AMX);
- MLflow and parquet storage under the absolute project state dir (``POSTTRAIN_STATE_DIR``, default
  ``<repo>/.state``).
Tests build their own with :func:`build_definitions`.
"""

import os

import dagster as dg

from assets.base_model import base_model
from assets.checkpoints import CHECKPOINTS, sft_checkpoint
from assets.datasets import chat_dataset
from assets.evals import eval_report
from assets.tokens import rendered_tokens
from pipelines.sft import build_recipe_jobs
from resources.mlflow import MlflowResource
from resources.parquet_io import ParquetIOManager
from resources.state import state_subdir
from resources.tinker import DEFAULT_BASE_MODEL, TinkerResource

SFT_DATA_ASSETS = ("base_model", "chat_dataset", "rendered_tokens")


def tinker_resource_from_env() -> TinkerResource:
    """Hosted when a key is exported, else local; EnvVar keeps the key and URL out of run config."""
    return TinkerResource(
        api_key=dg.EnvVar("TINKER_API_KEY") if os.environ.get("TINKER_API_KEY") else None,
        base_url=dg.EnvVar("TINKER_BASE_URL") if os.environ.get("TINKER_BASE_URL") else None,
        base_model=os.environ.get("POSTTRAIN_BASE_MODEL", DEFAULT_BASE_MODEL),
        local_dtype=os.environ.get("LOCALTINKER_DTYPE", "float32"),
    )


def default_resources() -> dict:
    return {
        "tinker": tinker_resource_from_env(),
        "mlflow": MlflowResource(ui_url=os.environ.get("MLFLOW_UI_URL", "http://127.0.0.1:5000")),
        "io_manager": ParquetIOManager(base_dir=str(state_subdir("parquet"))),
    }


def build_definitions(resources: dict) -> dg.Definitions:
    sft = build_recipe_jobs(
        "sft",
        data_assets=SFT_DATA_ASSETS,
        training_asset="sft_checkpoint",
        eval_asset="eval_report",
        partitions=CHECKPOINTS,
    )
    return dg.Definitions(
        assets=[base_model, chat_dataset, rendered_tokens, sft_checkpoint, eval_report],
        jobs=sft.jobs,
        sensors=[sft.sensor],
        schedules=[sft.schedule],
        resources=resources,
    )


defs = build_definitions(default_resources())
