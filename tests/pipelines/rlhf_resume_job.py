"""A reconstructable RLHF training job on the tiny model (from the base model), for the RLHF kill-and-resume test's child."""

import os
import sys
from pathlib import Path

import dagster as dg

from pipelines.definitions import build_definitions
from tests.fixtures.dagster_env import tiny_resources

RLHF_RESUME_STEPS = 6
RLHF_RESUME_CONFIG = {
    "ops": {
        "rlhf_checkpoint": {
            "config": {
                "init_from": "", "max_steps": RLHF_RESUME_STEPS, "save_every": 2, "lora_rank": 4, "learning_rate": 1e-3,
                "group_size": 2, "groups_per_batch": 2, "max_tokens": 8,
            }
        }
    },
    "execution": {"config": {"in_process": {}}},  # one process to kill; the re-execution inherits it
}


def tiny_rlhf_train_job() -> dg.JobDefinition:
    return build_definitions(tiny_resources(Path(os.environ["POSTTRAIN_STATE_DIR"]))).resolve_job_def("rlhf_train")


if __name__ == "__main__":
    with dg.DagsterInstance.get() as instance:
        result = dg.execute_job(dg.reconstructable(tiny_rlhf_train_job), instance=instance, run_config=RLHF_RESUME_CONFIG)
        sys.exit(0 if result.success else 1)
