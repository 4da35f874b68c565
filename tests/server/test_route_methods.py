"""A wrong method on a route outside /v1/ (``GET /tokenize``) is a 405 naming the allowed methods, in OpenAI's error
shape, as on /v1/ routes: the browser UI's static files answer only the paths the API does not have. Routing
happens before any handler runs, so the app is tested without its lifespan (no model)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from app.server import WEB_DIR, create_app
from app.settings import ServerSettings


@pytest.fixture(scope="module")
def client() -> TestClient:
    assert WEB_DIR.is_dir()  # (the UI is what took these paths)
    return TestClient(create_app(ServerSettings(session_store="memory")))


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/tokenize", {"POST"}),
        ("GET", "/detokenize", {"POST"}),
        ("HEAD", "/tokenize", {"POST"}),
        ("GET", "/v1/completions", {"POST"}),
        ("POST", "/version", {"GET", "HEAD"}),
    ],
)
def test_a_wrong_method_is_a_405_naming_the_allowed_ones(
    client: TestClient, method: str, path: str, allowed: set[str]
):
    response = client.request(method, path)
    assert response.status_code == 405, response.text
    assert {m.strip() for m in response.headers["allow"].split(",")} == allowed
    if method != "HEAD":
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith(f"{method} {path}: ")


def test_the_ui_still_serves_its_pages(client: TestClient):
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert client.get("/no-such-page.js").status_code == 404
