"""scripts/demo_stage.py's override syntax: `<op>.<field>=<value>`, values read as JSON where they parse."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import demo_stage  # noqa: E402


def test_overrides_group_by_op_and_read_json_values():
    found = demo_stage.parse_overrides([
        "rl_checkpoint.learning_rate=1e-4", "rl_checkpoint.env_options={\"num_epochs\": 2}",
        "rl_checkpoint.lr_schedule=constant", "eval.max_problems=64",
    ])
    assert found == {
        "rl_checkpoint": {"learning_rate": 1e-4, "env_options": {"num_epochs": 2}, "lr_schedule": "constant"},
        "eval": {"max_problems": 64},
    }


@pytest.mark.parametrize("item", ["learning_rate=1e-4", "rl_checkpoint.learning_rate"])
def test_an_override_without_op_or_value_names_the_syntax(item):
    with pytest.raises(SystemExit, match=r"write <op>\.<field>=<value>"):
        demo_stage.parse_overrides([item])
