"""The kill soak's child process: run ``<recipe>_train`` (or re-execute a run from failure) against the external
localtinker at ``TINKER_BASE_URL``, so the parent can SIGKILL this whole process group at any moment.

``python -m tests.reliability.soak_job <recipe> <run config json>`` or ``... <recipe> --from-failure <run id>``.
"""

import os
import sys
from pathlib import Path

import dagster as dg

from pipelines.definitions import build_definitions
from resources.mlflow import MlflowResource
from resources.parquet_io import ParquetIOManager
from resources.tinker import TinkerResource

IN_PROCESS = {"execution": {"config": {"in_process": {}}}}  # one process to kill; re-executions inherit it


def soak_resources() -> dict:
    state = Path(os.environ["POSTTRAIN_STATE_DIR"])
    return {
        "tinker": TinkerResource(backend="local", base_url=os.environ["TINKER_BASE_URL"], base_model=os.environ["POSTTRAIN_BASE_MODEL"]),
        "mlflow": MlflowResource(),
        "io_manager": ParquetIOManager(base_dir=str(state / "parquet")),
    }


def soak_train_job() -> dg.JobDefinition:
    return build_definitions(soak_resources()).resolve_job_def(f"{os.environ['SOAK_RECIPE']}_train")


if __name__ == "__main__":
    import json

    os.environ["SOAK_RECIPE"] = sys.argv[1]
    with dg.DagsterInstance.get() as instance:
        if sys.argv[2] == "--from-failure":
            options = dg.ReexecutionOptions.from_failure(sys.argv[3], instance)
            result = dg.execute_job(dg.reconstructable(soak_train_job), instance=instance, reexecution_options=options)
        else:
            config = {**json.loads(sys.argv[2]), **IN_PROCESS}
            result = dg.execute_job(dg.reconstructable(soak_train_job), instance=instance, run_config=config)
        sys.exit(0 if result.success else 1)
