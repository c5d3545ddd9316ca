"""The launchpad configs of every training job accept what the launchpad itself writes back."""

from __future__ import annotations

import dagster as dg
import pydantic
import pytest
import yaml
from dagster._core.snap import JobSnap
from dagster._core.snap.snap_to_yaml import default_values_yaml_from_type_snap

from assets.config_bridge import dagster_config
from pipelines.definitions import defs
from posttrain.training.config import AdamConfig

TRAINING_JOBS = sorted(
    job.name for job in defs.resolve_all_job_defs() if job.name.endswith(("_train", "_chain"))
)


def _as_javascript_writes_it(value: object) -> object:
    """The launchpad merges scaffolded YAML in JavaScript, which prints 1e-12 where PyYAML printed 1.0e-12."""
    if isinstance(value, dict):
        return {key: _as_javascript_writes_it(item) for key, item in value.items()}
    if isinstance(value, float) and value != 0 and abs(value) < 1e-6:
        return yaml.safe_load(repr(value).replace("e-0", "e-"))  # PyYAML (YAML 1.1) reads this back as a str
    return value


def test_every_recipe_has_its_train_and_chain_job_here() -> None:
    recipes = ("sft", "dpo", "rl", "code_rl", "distill", "prompt_distill")
    assert {f"{recipe}_{kind}" for recipe in recipes for kind in ("train", "chain")} <= set(TRAINING_JOBS)


def _scaffold(job: dg.JobDefinition) -> dict:
    """What the launchpad's "Scaffold all default config" writes for ``job`` (Dagster's own function)."""
    snap = JobSnap.from_job_def(job)
    schema = snap.config_schema_snapshot
    root = schema.get_config_snap(snap.mode_def_snaps[0].root_config_key)
    return yaml.safe_load(default_values_yaml_from_type_snap(schema, root))


@pytest.mark.parametrize("job_name", TRAINING_JOBS)
def test_scaffolded_defaults_rewritten_by_the_launchpad_are_valid_run_config(job_name: str) -> None:
    job = defs.resolve_job_def(job_name)
    assert dg.validate_run_config(job, _as_javascript_writes_it(_scaffold(job)))


@pytest.mark.parametrize("job_name", TRAINING_JOBS)
def test_every_training_job_scaffolds_the_knobs_a_person_edits(job_name: str) -> None:
    """A job config that pins a few op fields (a chain variant) must not hide the rest from the scaffold."""
    job = defs.resolve_job_def(job_name)
    training_ops = [op for op in _scaffold(job)["ops"] if op.endswith("_checkpoint")]
    assert training_ops, job_name
    for op in training_ops:
        scaffolded = _scaffold(job)["ops"][op]["config"]
        whole = {key for key, value in job.asset_layer.get(dg.AssetKey(op)).assets_def.op.config_field.default_value.items()
                 if value is not None}
        assert {"learning_rate", "lora_rank", "save_every", "init_from", "adam"} <= set(scaffolded), f"{job_name}: {op}"
        assert set(scaffolded) == whole, f"{job_name}: {op} scaffolds {sorted(scaffolded)}"


def test_a_float_typed_in_exponent_notation_is_read_as_that_number() -> None:
    config_cls = dagster_config("ExampleAdam", AdamConfig)
    parsed = yaml.safe_load("eps: 1e-8\nbeta1: 0.85\n")
    assert isinstance(parsed["eps"], str)  # what PyYAML hands Dagster
    config = config_cls(**parsed)
    assert config.eps == 1e-8 and isinstance(config.eps, float) and config.beta1 == 0.85


def test_a_float_field_given_a_word_names_the_value() -> None:
    config_cls = dagster_config("ExampleAdamWord", AdamConfig)
    with pytest.raises(pydantic.ValidationError, match="expected a number such as .* got 'tiny'"):
        config_cls(eps="tiny")
