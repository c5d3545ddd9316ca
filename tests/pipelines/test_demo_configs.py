"""Every stage of `make demo` and of `demo --stages rlhf` launches: its run config is valid for its chain job.

A renamed or retyped config field would otherwise surface only minutes into a demo run.
"""

import dagster as dg
import pytest

from pipelines.definitions import defs
from pipelines.demo import QUIET, STAGE_SETS


@pytest.mark.parametrize(("stage_set", "stage"), [(name, stage) for name, stages in STAGE_SETS.items() for stage in stages],
                         ids=lambda value: value if isinstance(value, str) else value.recipe)
def test_each_demo_stage_run_config_is_valid_for_its_chain_job(stage_set, stage):
    result = dg.validate_run_config(defs.resolve_job_def(stage.chain_job), {**QUIET, "ops": stage.run_config})
    assert result, f"{stage_set}/{stage.recipe}: {stage.run_config}"


def test_a_stage_config_with_a_misspelt_field_is_refused():
    stage = STAGE_SETS["default"][0]
    broken = {**stage.run_config, "sft_checkpoint": {"config": {"learning_rat": 1e-3, "batch_size": "big"}}}
    with pytest.raises(dg.DagsterInvalidConfigError, match="learning_rat"):
        dg.validate_run_config(defs.resolve_job_def(stage.chain_job), {**QUIET, "ops": broken})
