"""Links to the MLflow UI that keep working when the UI moves (`make ui --mlflow-port …`).

Asset pages store MLflow links relative to the Dagster UI: ``/mlflow/#/experiments/<id>/runs/<run>``.
`make ui` serves the Dagster UI with a ``/mlflow`` route that redirects to wherever it started the MLflow UI
(pipelines/webserver.py), so a link written by `make demo`, or under another port, resolves at view time.
Terminals cannot follow a relative link: the CLI prints :func:`absolute_mlflow_url` of it instead.
"""

from __future__ import annotations

import os

MLFLOW_LINK_PREFIX = "/mlflow/"
MLFLOW_UI_URL_ENV = "MLFLOW_UI_URL"
DEFAULT_MLFLOW_UI_URL = "http://127.0.0.1:5000"


def mlflow_ui_url() -> str:
    """Where the MLflow UI is served: ``$MLFLOW_UI_URL`` (`make ui` sets it from ``--mlflow-port``), else the default."""
    return os.environ.get(MLFLOW_UI_URL_ENV) or DEFAULT_MLFLOW_UI_URL


def mlflow_link(fragment: str) -> str:
    """The asset-page link to an MLflow UI page, e.g. ``mlflow_link("#/models/sft")`` → ``/mlflow/#/models/sft``."""
    return MLFLOW_LINK_PREFIX + fragment.lstrip("/")


def registered_model_url(model_name: str) -> str:
    """The asset-page link to a registered model's page: its versions and the aliases they hold now."""
    return mlflow_link(f"#/models/{model_name}")


def absolute_mlflow_url(link: str, ui_url: str | None = None) -> str:
    """``link`` as an absolute URL of the MLflow UI at ``ui_url`` (default :func:`mlflow_ui_url`); other URLs unchanged."""
    if not link.startswith(MLFLOW_LINK_PREFIX):
        return link
    return f"{(ui_url or mlflow_ui_url()).rstrip('/')}/{link[len(MLFLOW_LINK_PREFIX):]}"
