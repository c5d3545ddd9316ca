"""A reconstructable SFT training job on the tiny model, for the kill-and-resume test's child process."""

import os
import sys
from pathlib import Path

import dagster as dg

from pipelines.definitions import build_definitions
from tests.fixtures.dagster_env import tiny_resources

RESUME_CONFIG = {
    "ops": {"sft_checkpoint": {"config": {"batch_size": 4, "max_steps": 8, "save_every": 2, "lora_rank": 4}}},
    "execution": {"config": {"in_process": {}}},  # one process to kill; the re-execution inherits it
}


def tiny_train_job() -> dg.JobDefinition:
    return build_definitions(tiny_resources(Path(os.environ["POSTTRAIN_STATE_DIR"]))).resolve_job_def("sft_train")


if __name__ == "__main__":
    with dg.DagsterInstance.get() as instance:
        result = dg.execute_job(dg.reconstructable(tiny_train_job), instance=instance, run_config=RESUME_CONFIG)
        sys.exit(0 if result.success else 1)
