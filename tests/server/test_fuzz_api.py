"""The API fuzzed from its own OpenAPI document (schemathesis generates the requests; the app runs in this process
under Starlette's TestClient, default model): valid and invalid bodies, path and query parameters for every
operation. No request may get a 5xx, every 4xx is in
OpenAI's error shape, answers conform to the document (status codes, content types), invalid data is refused;
afterwards the server is healthy and no KV block is held by anyone (nothing leaked by the refused, failed or cut
requests).

Bounded for CI (under a minute on 2 vCPUs): ``PAGEDCHAT_FUZZ_EXAMPLES`` examples per operation and mode (40 by
default; more for a deeper search), a 128-token context, 4 tokens for requests without max_tokens and at most 256
tokens a request (``--max-request-tokens``: prompts x n x max_tokens would otherwise let one schema-valid completion
keep the engine busy for minutes; at 1024, 100 examples of each generating operation took 65-105 s) keep each answer
short. Hypothesis is derandomized (its seed is a hash of the test), so every run sends the same examples and takes
about the same time."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.testclient import TestClient

from app.server import OPERATIONS, create_app
from app.settings import ServerSettings
from engine.config import EngineConfig
from tests.server_harness import SMALL_KV_GIB

pytestmark = pytest.mark.slow

MAX_EXAMPLES = int(os.environ.get("PAGEDCHAT_FUZZ_EXAMPLES", "40"))
MAX_REQUEST_TOKENS = 256  # of one request: 2 full contexts
ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    """One app for the whole module (its lifespan runs once: model load, warm-up); schemathesis's own ASGI
    transport would start and stop it around every test."""
    settings = ServerSettings(
        default_max_tokens=4,
        max_request_tokens=MAX_REQUEST_TOKENS,
        max_request_bytes=256 * 1024,
        session_store="memory",
        engine=EngineConfig(kv_cache_memory_gib=float(SMALL_KV_GIB), max_model_len=128),
    )
    with TestClient(create_app(settings)) as client:
        yield client


# invalid data may also be refused as too large (413): a list past its maxItems (4096 messages) takes more bytes
# than the server reads
NEGATIVE_STATUSES = [400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429, "5xx"]


@pytest.fixture(scope="module")
def api_schema(client: TestClient) -> Any:
    config = SchemathesisConfig.from_dict(
        {"checks": {"negative_data_rejection": {"expected-statuses": NEGATIVE_STATUSES}}}
    )
    return schemathesis.openapi.from_dict(client.get("/openapi.json").json(), config=config)


def send(client: TestClient, case: Any) -> Any:
    """The case as schemathesis would send it (its requests-style arguments), through the TestClient."""
    kwargs = case.as_transport_kwargs(base_url=str(client.base_url))
    body = {"json": kwargs["json"]} if "json" in kwargs else {"content": kwargs.get("data")}
    return client.request(
        kwargs["method"],
        kwargs["url"],
        params=kwargs.get("params"),
        headers=dict(kwargs.get("headers") or {}),
        **body,
    )


# every operation with valid data, and with invalid data where it takes any (a body or parameters); the routes
# of one session also on a session that exists (random ids find none), its deletion last
CASES = [
    (op.method, op.path, mode, False)
    for op in OPERATIONS
    for mode in ("positive", "negative")
    if mode == "positive" or op.body is not None or "{" in op.path or op.query
]
CASES += sorted(
    ((op.method, op.path, "positive", True) for op in OPERATIONS if "{session_id}" in op.path),
    key=lambda case: case[0] == "DELETE",
)


@pytest.fixture(scope="module")
def session_id(client: TestClient) -> str:
    created = client.post("/v1/sessions", json={"system": "You are brief."})
    assert created.status_code == 201
    return created.json()["id"]


@pytest.mark.parametrize(("method", "path", "mode", "existing"), CASES)
def test_no_request_gets_a_5xx_and_every_4xx_is_an_openai_error(
    client: TestClient,
    api_schema: Any,
    session_id: str,
    method: str,
    path: str,
    mode: str,
    existing: bool,
) -> None:
    operation = api_schema[path][method]
    fixed = {"path_parameters": {"session_id": session_id}} if existing else {}

    @given(case=operation.as_strategy(generation_mode=GenerationMode(mode), **fixed))
    @settings(
        max_examples=MAX_EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case: Any) -> None:
        response = send(client, case)
        case.validate_response(
            response,
            checks=[
                not_a_server_error,
                status_code_conformance,
                content_type_conformance,
                response_schema_conformance,
                negative_data_rejection,
            ],
        )
        if 400 <= response.status_code < 500:
            error = response.json()["error"]
            assert set(error) == ERROR_FIELDS, response.text
            assert (
                isinstance(error["message"], str)
                and error["message"]
                and isinstance(error["type"], str)
            )
            assert error["param"] is None or isinstance(error["param"], str)

    fuzz()


def test_after_the_fuzzing_the_server_is_healthy_and_no_block_is_held(client: TestClient) -> None:
    server = client.app.state.server
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = server.engine.stats()
        if stats.num_running == stats.num_waiting == 0 and stats.kv_usage == 0:
            break
        time.sleep(0.1)
    stats = server.engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0)
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert server.engine.healthy and stats.prompt_tokens > 0, "the fuzzing reached the engine"
