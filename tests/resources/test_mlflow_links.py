"""Asset pages link MLflow through the Dagster UI's /mlflow redirect; terminals get absolute URLs."""

import pytest

from resources.mlflow_links import DEFAULT_MLFLOW_UI_URL, absolute_mlflow_url, mlflow_link, mlflow_ui_url


def test_links_are_relative_to_the_dagster_ui_and_carry_no_port():
    link = mlflow_link("#/experiments/3/runs/abc")
    assert link == "/mlflow/#/experiments/3/runs/abc"
    assert "5000" not in link and "://" not in link


def test_absolute_url_follows_the_configured_ui(monkeypatch: pytest.MonkeyPatch):
    link = mlflow_link("#/models/sft")
    monkeypatch.delenv("MLFLOW_UI_URL", raising=False)
    assert mlflow_ui_url() == DEFAULT_MLFLOW_UI_URL
    assert absolute_mlflow_url(link) == "http://127.0.0.1:5000/#/models/sft"
    monkeypatch.setenv("MLFLOW_UI_URL", "http://127.0.0.1:5123/")
    assert absolute_mlflow_url(link) == "http://127.0.0.1:5123/#/models/sft"
    assert absolute_mlflow_url(link, "http://mlflow.example") == "http://mlflow.example/#/models/sft"


def test_an_absolute_url_recorded_by_an_older_version_is_left_as_it_is():
    assert absolute_mlflow_url("http://127.0.0.1:5000/#/experiments/1/runs/x") == "http://127.0.0.1:5000/#/experiments/1/runs/x"
