"""The Dagster webserver `make ui` runs: Dagster's own app, plus ``/mlflow``, a redirect to the MLflow UI.

Asset pages link MLflow as ``/mlflow/#/experiments/<id>/runs/<run>`` (``resources.mlflow.MLFLOW_LINK_PREFIX``):
relative to the Dagster UI, so a link resolves wherever `make ui` serves MLflow (``--mlflow-port``), also on
pages materialized before (by `make demo`, or under another port). The browser keeps the ``#…`` part
across the redirect. Run as ``python -m pipelines.webserver --port P --mlflow-ui-url URL``.
"""

from __future__ import annotations

import argparse
import os

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse
from starlette.routing import Mount, Route
from starlette.types import ASGIApp

from resources.mlflow_links import MLFLOW_LINK_PREFIX

CODE_LOCATION_MODULE = "pipelines.definitions"


def with_mlflow_redirect(dagster_app: ASGIApp, mlflow_ui_url: str) -> Starlette:
    """``dagster_app`` with ``/mlflow`` and ``/mlflow/…`` answered by a redirect to ``mlflow_ui_url``/…."""
    base = mlflow_ui_url.rstrip("/")

    async def redirect(request: Request) -> RedirectResponse:
        rest = request.path_params.get("rest", "")
        query = f"?{request.url.query}" if request.url.query else ""
        return RedirectResponse(f"{base}/{rest}{query}", status_code=307)

    prefix = MLFLOW_LINK_PREFIX.rstrip("/")
    return Starlette(
        routes=[Route(prefix, redirect), Route(f"{prefix}/{{rest:path}}", redirect), Mount("/", app=dagster_app)]
    )


def serve(host: str, port: int, mlflow_ui_url: str) -> None:
    import uvicorn
    from dagster import DagsterInstance
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load_target import ModuleTarget
    from dagster_webserver.app import create_app_from_workspace_process_context
    from dagster_webserver.version import __version__

    target = ModuleTarget(module_name=CODE_LOCATION_MODULE, attribute=None, working_directory=os.getcwd(), location_name=None)
    with DagsterInstance.get() as instance, WorkspaceProcessContext(
        instance, workspace_load_target=target, version=__version__
    ) as context:
        app = with_mlflow_redirect(create_app_from_workspace_process_context(context), mlflow_ui_url)
        uvicorn.run(app, host=host, port=port, log_level="warning")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipelines.webserver", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=3000)
    parser.add_argument("--mlflow-ui-url", required=True, help="where the MLflow UI is served, e.g. http://127.0.0.1:5000")
    args = parser.parse_args(argv)
    serve(args.host, args.port, args.mlflow_ui_url)


if __name__ == "__main__":
    main()
