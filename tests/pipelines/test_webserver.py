"""`make ui`'s webserver: /mlflow redirects to the MLflow UI it was started with; every other path is Dagster's."""

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pipelines.webserver import with_mlflow_redirect
from resources.mlflow_links import mlflow_link


def _dagster_stand_in() -> Starlette:
    async def page(request):
        return PlainTextResponse(f"dagster {request.url.path}")

    return Starlette(routes=[Route("/{path:path}", page)])


def test_mlflow_links_redirect_to_the_configured_mlflow_ui_and_the_rest_reaches_dagster():
    client = TestClient(with_mlflow_redirect(_dagster_stand_in(), "http://127.0.0.1:5123/"), follow_redirects=False)
    link = mlflow_link("#/experiments/1/runs/abc")
    response = client.get(link)  # the browser sends the path; it re-applies "#/experiments/1/runs/abc" after the redirect
    assert response.status_code == 307 and response.headers["location"] == "http://127.0.0.1:5123/"
    assert client.get("/mlflow").headers["location"] == "http://127.0.0.1:5123/"
    assert client.get("/mlflow/ajax-api/2.0/mlflow/runs/get").headers["location"] == "http://127.0.0.1:5123/ajax-api/2.0/mlflow/runs/get"
    artifact = client.get("/mlflow/get-artifact?path=rollouts%2Fa.png&run_uuid=r1").headers["location"]
    assert artifact == "http://127.0.0.1:5123/get-artifact?path=rollouts%2Fa.png&run_uuid=r1"
    assert client.get("/assets/rl_eval_report").text == "dagster /assets/rl_eval_report"
