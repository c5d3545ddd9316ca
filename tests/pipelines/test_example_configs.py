"""examples/configs/*.yaml, which the README tells users to pass to `dagster job execute -c`, fit their jobs."""

from pathlib import Path

import dagster as dg
import pytest
import yaml

from pipelines.definitions import build_definitions
from tests.fixtures.dagster_env import tiny_resources

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "examples" / "configs").glob("*.yaml"))


def test_every_recipe_chain_has_an_example_config():
    assert {path.stem for path in CONFIGS} == {
        "sft", "dpo", "dpo_offline", "rl", "code_rl", "distill", "prompt_distill", "preference_model", "rlhf"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.stem)
def test_example_config_validates_against_its_chain_job(path: Path, project_state):
    job = build_definitions(tiny_resources(project_state)).resolve_job_def(f"{path.stem}_chain")
    result = dg.validate_run_config(job, yaml.safe_load(path.read_text()))
    assert result["ops"], path


HUB_CONFIGS = sorted((Path(__file__).resolve().parents[2] / "examples" / "configs" / "hub").glob("*.yaml"))


@pytest.mark.parametrize("path", HUB_CONFIGS, ids=lambda path: path.stem)
def test_hub_dataset_example_validates_against_its_chain_job(path: Path, project_state):
    """examples/configs/hub/<recipe>.<dataset>.yaml: the README's hub-dataset runs fit `<recipe>_chain`."""
    job = build_definitions(tiny_resources(project_state)).resolve_job_def(f"{path.stem.split('.')[0]}_chain")
    assert dg.validate_run_config(job, yaml.safe_load(path.read_text()))["ops"], path


ROUND_CONFIGS = sorted((Path(__file__).resolve().parents[2] / "examples" / "configs" / "rounds").glob("*.yaml"))


def test_round_configs_exist():
    assert [path.stem for path in ROUND_CONFIGS] == ["preference_model"]


@pytest.mark.parametrize("path", ROUND_CONFIGS, ids=lambda path: path.stem)
def test_round_example_validates_against_its_chain_job(path: Path, project_state):
    """examples/configs/rounds/<recipe>.yaml: a later round of an iterated recipe (docs/rlhf.md) fits `<recipe>_chain`."""
    job = build_definitions(tiny_resources(project_state)).resolve_job_def(f"{path.stem}_chain")
    assert dg.validate_run_config(job, yaml.safe_load(path.read_text()))["ops"], path
