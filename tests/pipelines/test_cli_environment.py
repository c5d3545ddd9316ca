"""`python -m pipelines` follows the environment for hub access: only `demo` (generated data) goes offline."""

from __future__ import annotations

import os

import pytest

from pipelines.__main__ import main

OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def test_lineage_leaves_hub_access_to_the_environment(project_state, monkeypatch: pytest.MonkeyPatch, capsys):
    for name in OFFLINE:
        monkeypatch.delenv(name, raising=False)
    assert main(["lineage", "--list"]) == 0
    assert not any(name in os.environ for name in OFFLINE)
