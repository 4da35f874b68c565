"""Every failure in OpenAI's error shape with the right status: bad requests (a table: every numeric field in its
real range, named), the API key, the body size cap and media type, unknown routes and methods (405 with ``Allow``),
a client gone in the middle of its body (one log line), a request the engine fails on its own (that request only
ends, with ``request_failed``), and an engine that dies (in-process, where the test can break the model runner):
503 before a stream starts, an error event then ``[DONE]`` after, and ``pagedchat serve`` exits non-zero."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from app.serve import ENGINE_DIED, run_server
from app.server import create_app
from app.settings import ServerSettings
from engine.config import EngineConfig
from engine.request_stream import RequestFailedError
from tests import engine_faults
from tests.engine_faults import call_in_engine
from tests.server_harness import (
    SMALL_KV_GIB,
    RunningServer,
    free_port,
    one_torch_thread,
    server_fixture,
    sse_chunks,
    sse_data,
)

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 128
MAX_REQUEST_BYTES = 4096
KEYS = ("first-key", "second-key")

# small limits, and two API keys (a comma-separated list)
guarded_server = server_fixture(
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-request-bytes",
    str(MAX_REQUEST_BYTES),
    "--api-key",
    ",".join(KEYS),
)

HI = [{"role": "user", "content": "Hi"}]
# ~150 tokens of text: over MAX_MODEL_LEN on its own, yet well under MAX_REQUEST_BYTES
LONG_TEXT = " hello" * 150


@pytest.fixture(scope="module")
def api(guarded_server: RunningServer) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    with httpx.Client(base_url=guarded_server.base_url, headers=headers, timeout=60) as client:
        yield client


def chat(**fields: Any) -> bytes:
    return json.dumps({"messages": HI, "max_tokens": 4, **fields}).encode()


def raw(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def chat_text(extra: str) -> bytes:
    """A chat body with a field written by hand (JSON extensions such as NaN that json.dumps would not write)."""
    return (
        b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, '
        + extra.encode()
        + b"}"
    )


# (route, body, status, error.type, error.param, words the message must contain)
BAD_REQUESTS = {
    "malformed_json": (
        "/v1/chat/completions",
        b'{"messages": [',
        400,
        "invalid_request_error",
        None,
        ["JSON"],
    ),
    "empty_body": (
        "/v1/chat/completions",
        b"",
        400,
        "invalid_request_error",
        None,
        ["JSON object"],
    ),
    "body_is_a_list": (
        "/v1/chat/completions",
        b"[1, 2]",
        400,
        "invalid_request_error",
        None,
        ["object"],
    ),
    "body_is_a_string": (
        "/v1/completions",
        b'"hello"',
        400,
        "invalid_request_error",
        None,
        ["object"],
    ),
    "temperature_a_word": (
        "/v1/chat/completions",
        chat(temperature="hot"),
        400,
        "invalid_request_error",
        "temperature",
        ["number"],
    ),
    "max_tokens_a_string": (
        "/v1/chat/completions",
        chat(max_tokens="5"),
        400,
        "invalid_request_error",
        "max_tokens",
        ["integer"],
    ),
    "stream_a_string": (
        "/v1/chat/completions",
        chat(stream="yes"),
        400,
        "invalid_request_error",
        "stream",
        ["bool"],
    ),
    "unknown_role": (
        "/v1/chat/completions",
        raw(messages=[{"role": "robot", "content": "x"}]),
        400,
        "invalid_request_error",
        "messages.0.role",
        ["user"],
    ),
    "user_without_content": (
        "/v1/chat/completions",
        raw(messages=[{"role": "user"}]),
        400,
        "invalid_request_error",
        "messages.0.content",
        ["required"],
    ),
    "missing_messages": (
        "/v1/chat/completions",
        raw(model=MODEL),
        400,
        "invalid_request_error",
        "messages",
        ["required"],
    ),
    "empty_messages": (
        "/v1/chat/completions",
        raw(messages=[]),
        400,
        "invalid_request_error",
        "messages",
        ["at least 1"],
    ),
    "n_0": ("/v1/chat/completions", chat(n=0), 400, "invalid_request_error", "n", [">= 1"]),
    "n_129": ("/v1/chat/completions", chat(n=129), 400, "invalid_request_error", "n", ["<= 128"]),
    "top_logprobs_without_logprobs": (
        "/v1/chat/completions",
        chat(top_logprobs=2),
        400,
        "invalid_request_error",
        "top_logprobs",
        ["logprobs"],
    ),
    "tool_name": (
        "/v1/chat/completions",
        chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
        400,
        "invalid_request_error",
        "tools.0.function.name",
        ["pattern"],
    ),
    "tool_choice_without_tools": (
        "/v1/chat/completions",
        chat(tool_choice="required"),
        400,
        "invalid_request_error",
        "tool_choice",
        ["needs tools"],
    ),
    "unknown_model": (
        "/v1/chat/completions",
        chat(model="gpt-4"),
        404,
        "not_found_error",
        "model",
        ["gpt-4"],
    ),
    "prompt_plus_max_tokens_over_context": (
        "/v1/chat/completions",
        chat(max_tokens=MAX_MODEL_LEN),
        400,
        "invalid_request_error",
        "max_tokens",
        [str(MAX_MODEL_LEN)],
    ),
    "prompt_alone_over_context": (
        "/v1/chat/completions",
        raw(messages=[{"role": "user", "content": LONG_TEXT}]),
        400,
        "invalid_request_error",
        "messages",
        [str(MAX_MODEL_LEN)],
    ),
    "negative_temperature": (
        "/v1/chat/completions",
        chat(temperature=-0.5),
        400,
        "invalid_request_error",
        "temperature",
        [">= 0"],
    ),
    "top_p_zero": (
        "/v1/chat/completions",
        chat(top_p=0),
        400,
        "invalid_request_error",
        "top_p",
        ["> 0"],
    ),
    "temperature_above_openais_2": (
        "/v1/chat/completions",
        chat(temperature=3.4e38),
        400,
        "invalid_request_error",
        "temperature",
        ["<= 2"],
    ),
    "empty_session_id": (
        "/v1/chat/completions",
        chat(session_id=""),
        400,
        "invalid_request_error",
        "session_id",
        ["empty"],
    ),
    "negative_stop_token_id": (
        "/v1/chat/completions",
        chat(stop_token_ids=[-1]),
        400,
        "invalid_request_error",
        "stop_token_ids.0",
        [">= 0"],
    ),
    # every numeric field in its real range (the engine's), refused with the field named
    "temperature_not_finite": (
        "/v1/chat/completions",
        chat_text('"temperature": NaN'),
        400,
        "invalid_request_error",
        "temperature",
        ["finite"],
    ),
    "seed_beyond_64_bits": (
        "/v1/chat/completions",
        chat(seed=2**64),
        400,
        "invalid_request_error",
        "seed",
        [str(2**64)],
    ),
    "seed_below_64_bits": (
        "/v1/chat/completions",
        chat(seed=-(2**63) - 1),
        400,
        "invalid_request_error",
        "seed",
        [str(-(2**63))],
    ),
    "top_k_beyond_the_vocabulary": (
        "/v1/chat/completions",
        chat(top_k=10**6, top_p=0.5),
        400,
        "invalid_request_error",
        "top_k",
        ["vocabulary"],
    ),
    "top_k_beyond_int32": (
        "/v1/chat/completions",
        chat(top_k=2**40),
        400,
        "invalid_request_error",
        "top_k",
        ["<"],
    ),
    "top_k_below_minus_one": (
        "/v1/chat/completions",
        chat(top_k=-2),
        400,
        "invalid_request_error",
        "top_k",
        [">= -1"],
    ),
    "max_tokens_beyond_int32": (
        "/v1/chat/completions",
        chat(max_tokens=2**31),
        400,
        "invalid_request_error",
        "max_tokens",
        ["<"],
    ),
    "min_tokens_over_max_tokens": (
        "/v1/chat/completions",
        chat(min_tokens=10),
        400,
        "invalid_request_error",
        "min_tokens",
        ["max_tokens"],
    ),
    "repetition_penalty_near_zero": (
        "/v1/chat/completions",
        chat(repetition_penalty=5e-324),
        400,
        "invalid_request_error",
        "repetition_penalty",
        [">= 0.01"],
    ),
    "presence_penalty_over_two": (
        "/v1/chat/completions",
        chat(presence_penalty=2.5),
        400,
        "invalid_request_error",
        "presence_penalty",
        ["<= 2"],
    ),
    "too_many_stop_strings": (
        "/v1/chat/completions",
        chat(stop=[f"s{i}" for i in range(17)]),
        400,
        "invalid_request_error",
        "stop",
        ["16"],
    ),
    "stop_string_too_long": (
        "/v1/chat/completions",
        chat(stop="x" * 257),
        400,
        "invalid_request_error",
        "stop",
        ["256"],
    ),
    "too_many_stop_token_ids": (
        "/v1/chat/completions",
        chat(stop_token_ids=list(range(65))),
        400,
        "invalid_request_error",
        "stop_token_ids",
        ["64"],
    ),
    "logit_bias_token_out_of_vocabulary": (
        "/v1/chat/completions",
        chat(logit_bias={"999999": 5}),
        400,
        "invalid_request_error",
        "logit_bias",
        ["token ids"],
    ),
    "logit_bias_key_not_a_token_id": (
        "/v1/chat/completions",
        chat(logit_bias={"hello": 5}),
        400,
        "invalid_request_error",
        "logit_bias",
        [],
    ),
    "logit_bias_over_100": (
        "/v1/chat/completions",
        chat(logit_bias={"42": 101}),
        400,
        "invalid_request_error",
        "logit_bias",
        ["<= 100"],
    ),
    "too_many_logit_biases": (
        "/v1/chat/completions",
        chat(logit_bias={str(i): 1 for i in range(301)}),
        400,
        "invalid_request_error",
        "logit_bias",
        ["300"],
    ),
    "response_format_unknown_type": (
        "/v1/chat/completions",
        chat(response_format={"type": "xml"}),
        400,
        "invalid_request_error",
        "response_format.type",
        ["json_schema"],
    ),
    "response_format_schema_missing": (
        "/v1/chat/completions",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "invalid_request_error",
        "response_format.json_schema.schema",
        ["required"],
    ),
    "response_format_invalid_schema": (
        "/v1/chat/completions",
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
            }
        ),
        400,
        "invalid_request_error",
        "response_format",
        ["schema"],
    ),
    "completion_negative_token_id": (
        "/v1/completions",
        raw(prompt=[5, -1]),
        400,
        "invalid_request_error",
        "prompt.1",
        [">= 0"],
    ),
    "max_tokens_zero": (
        "/v1/chat/completions",
        chat(max_tokens=0),
        400,
        "invalid_request_error",
        "max_tokens",
        [">= 1"],
    ),
    "completion_without_prompt": (
        "/v1/completions",
        raw(max_tokens=3),
        400,
        "invalid_request_error",
        "prompt",
        ["required"],
    ),
    "completion_prompt_over_context": (
        "/v1/completions",
        raw(prompt=LONG_TEXT),
        400,
        "invalid_request_error",
        "prompt",
        [str(MAX_MODEL_LEN)],
    ),
    "completion_empty_prompt_list": (
        "/v1/completions",
        raw(prompt=[]),
        400,
        "invalid_request_error",
        "prompt",
        [],
    ),
    "completion_token_id_out_of_vocabulary": (
        "/v1/completions",
        raw(prompt=[10**9]),
        400,
        "invalid_request_error",
        "prompt",
        ["token ids"],
    ),
    "completion_echo_with_logprobs": (
        "/v1/completions",
        raw(prompt="Hi", echo=True, logprobs=1),
        400,
        "invalid_request_error",
        "echo",
        ["logprobs"],
    ),
    "body_over_the_size_cap": (
        "/v1/chat/completions",
        raw(messages=[{"role": "user", "content": "x" * 5000}]),
        413,
        "invalid_request_error",
        None,
        [str(MAX_REQUEST_BYTES)],
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_an_openai_error(api: httpx.Client, case: str):
    route, body, status, error_type, param, words = BAD_REQUESTS[case]
    response = api.post(route, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type
    assert error["param"] == param
    assert error["message"]
    if param is not None:
        assert error["message"].startswith(param), "the message names the field first"
    for word in words:
        assert word in error["message"]


def test_chunked_body_over_the_size_cap_is_refused_while_reading(api: httpx.Client):
    """No Content-Length to trust: the cap is enforced on the bytes as they arrive."""

    def body() -> Iterator[bytes]:
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(MAX_REQUEST_BYTES // 256 + 1):
            yield b"x" * 256
        yield b'"}]}'

    response = api.post(
        "/v1/chat/completions", content=body(), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    "method, path",
    [("GET", "/v1/no-such-route"), ("POST", "/v1/no-such-route"), ("POST", "/v1/chat/completion")],
)
def test_unknown_route_is_a_json_404(api: httpx.Client, method: str, path: str):
    response = api.request(method, path, json={"messages": HI})
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["type"] == "not_found_error" and path in error["message"]


def test_server_still_answers_after_the_bad_requests(api: httpx.Client):
    response = api.post(
        "/v1/chat/completions", json={"messages": HI, "max_tokens": 4, "temperature": 0}
    )
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] >= 1


# API key -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong-key", f"Basic {KEYS[0]}", "Bearer", f"Bearer {KEYS[0]}x"]
)
@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/chat/completions")])
def test_v1_routes_need_the_api_key(
    guarded_server: RunningServer, authorization: str | None, method: str, path: str
):
    headers = {"Authorization": authorization} if authorization is not None else {}
    response = httpx.request(
        method, guarded_server.url(path), headers=headers, json={"messages": HI}, timeout=30
    )
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert "API key" in error["message"]


@pytest.mark.parametrize("key", KEYS)
def test_every_configured_key_works_with_the_openai_client(guarded_server: RunningServer, key: str):
    client = openai.OpenAI(
        base_url=guarded_server.openai_base_url, api_key=key, max_retries=0, timeout=60
    )
    assert [m.id for m in client.models.list()] == [MODEL]
    reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens >= 1


def test_openai_client_with_a_wrong_key_gets_authentication_error(guarded_server: RunningServer):
    client = openai.OpenAI(
        base_url=guarded_server.openai_base_url, api_key="wrong", max_retries=0, timeout=60
    )
    with pytest.raises(openai.AuthenticationError) as caught:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("PUT", "/v1/sessions", {"GET", "HEAD", "POST"}),
        ("POST", "/v1/sessions/AAAAAAAAAAAAAAAAAAAAAA", {"GET", "HEAD", "PATCH", "DELETE"}),
        ("GET", "/v1/chat/completions", {"POST"}),
        ("DELETE", "/v1/presets", {"GET", "HEAD", "POST"}),
        ("POST", "/health", {"GET", "HEAD"}),
    ],
)
def test_wrong_method_is_a_405_naming_the_allowed_ones(
    api: httpx.Client, method: str, path: str, allowed: set[str]
):
    response = api.request(method, path)
    assert response.status_code == 405, response.text
    assert {m.strip() for m in response.headers["allow"].split(",")} == allowed
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_openapi_declares_path_parameters_and_metrics_as_text(api: httpx.Client):
    doc = api.get("/openapi.json").json()
    for path, operations in doc["paths"].items():
        in_path = set(re.findall(r"{(\w+)}", path))
        for method, operation in operations.items():
            declared = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
            assert declared == in_path, (method, path)
            assert all(p["required"] for p in operation.get("parameters", []) if p["in"] == "path")
    listing = {
        p["name"] for p in doc["paths"]["/v1/sessions"]["get"]["parameters"] if p["in"] == "query"
    }
    assert listing == {"limit", "after", "source", "q"}
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "201" in doc["paths"]["/v1/sessions"]["post"]["responses"]
    text = json.dumps(doc)
    # pydantic's names: a bound that did not become JSON Schema
    for keyword in ("ge", "gt", "le", "lt"):
        assert f'"{keyword}":' not in text
    metrics = api.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize("path", ["/health", "/metrics", "/openapi.json"])
def test_health_metrics_and_schema_stay_open_without_a_key(
    guarded_server: RunningServer, path: str
):
    assert httpx.get(guarded_server.url(path), timeout=30).status_code == 200


# engine failures (in-process) ----------------------------------------------------------------------


@pytest.fixture
def in_process() -> Iterator[TestClient]:
    """The app in this process (TestClient runs its lifespan: model load, warm-up), so a test can reach the
    engine's model runner and make it fail."""
    settings = ServerSettings(
        session_store="memory", engine=EngineConfig(kv_cache_memory_gib=float(SMALL_KV_GIB))
    )
    with (
        one_torch_thread(),
        TestClient(create_app(settings), raise_server_exceptions=False) as client,
    ):
        yield client


def fail_model_after(client: TestClient | Any, num_calls: int) -> None:
    """The model runner (in the engine core's process) works ``num_calls`` more times, then raises (as a CUDA
    error or OOM would); ``client`` is a TestClient or the app itself."""
    engine = getattr(client, "app", client).state.server.engine
    call_in_engine(engine, engine_faults.fail_model_after, num_calls)


def assert_engine_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert int(response.headers["retry-after"]) >= 1
    error = response.json()["error"]
    assert error["type"] == "service_unavailable_error" and error["code"] == "engine_unavailable"


def test_failure_mid_stream_is_an_error_event_then_done(in_process: TestClient):
    healthy = in_process.get("/health")
    assert healthy.status_code == 200 and healthy.json()["status"] == "ok"
    fail_model_after(in_process, 3)  # the prefill and two decode steps succeed
    body = {"messages": HI, "temperature": 0, "max_tokens": 50, "ignore_eos": True, "stream": True}
    with in_process.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        chunks = sse_chunks(sse_data(response.iter_lines()))
    *ordinary, error_event = chunks
    assert ordinary[0]["choices"][0]["delta"]["role"] == "assistant"
    assert 2 <= len(ordinary) <= 4  # role chunk, then one content chunk per successful step
    assert all(c["choices"][0]["finish_reason"] is None for c in ordinary)
    assert set(error_event) == {"error"}
    error = error_event["error"]
    assert error["type"] == "service_unavailable_error" and error["code"] == "engine_unavailable"
    assert "injected model failure" in error["message"]
    assert in_process.get("/health").status_code == 503


def test_dead_engine_answers_503_and_health_turns_503(in_process: TestClient):
    fail_model_after(in_process, 0)
    with in_process.stream(
        "POST", "/v1/chat/completions", json={"messages": HI, "stream": True}
    ) as response:
        assert "engine_unavailable" in response.read().decode()  # the request the engine died under
    health = in_process.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "unhealthy"
    assert_engine_unavailable(
        in_process.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 8})
    )
    assert_engine_unavailable(
        in_process.post(
            "/v1/chat/completions", json={"messages": HI, "max_tokens": 8, "stream": True}
        )
    )
    assert_engine_unavailable(
        in_process.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 8})
    )
    # what does not need the engine still answers
    assert in_process.get("/v1/models").status_code == 200


def test_non_streaming_request_in_flight_when_the_engine_dies_gets_503(in_process: TestClient):
    fail_model_after(in_process, 2)
    response = in_process.post(
        "/v1/chat/completions", json={"messages": HI, "max_tokens": 20, "ignore_eos": True}
    )
    assert_engine_unavailable(response)
    assert "injected model failure" in response.json()["error"]["message"]


# one request failing on its own (in-process) ------------------------------------------------------


class _FailingStream:
    """An engine request's stream that ends with the request's own error after ``after`` outputs, as the engine
    reports a failure of one request (its sampling, grammar, detokenizing): RequestFailedError in its stream."""

    def __init__(self, stream: Any, after: int) -> None:
        self._stream, self._left = stream, after

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    def __aiter__(self) -> _FailingStream:
        return self

    async def __anext__(self) -> Any:
        if self._left == 0:
            raise RequestFailedError("ValueError: injected failure of this request")
        self._left -= 1
        return await self._stream.__anext__()

    async def aclose(self) -> None:
        await self._stream.aclose()


def fail_next_request(client: TestClient, after: int) -> None:
    engine = client.app.state.server.engine
    original = engine.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        engine.generate = original  # only this one
        return _FailingStream(original(*args, **kwargs), after)

    engine.generate = generate


def test_a_failed_request_ends_with_request_failed_and_the_server_keeps_serving(
    in_process: TestClient,
):
    fail_next_request(in_process, after=3)
    body = {"messages": HI, "temperature": 0, "max_tokens": 20, "ignore_eos": True, "stream": True}
    with in_process.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        chunks = sse_chunks(sse_data(response.iter_lines()))
    error = chunks[-1]["error"]
    assert (error["type"], error["code"]) == ("server_error", "request_failed")
    assert "injected failure" in error["message"]
    assert all("error" not in c for c in chunks[:-1]) and len(chunks) >= 2

    fail_next_request(in_process, after=1)
    whole = in_process.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 8})
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "request_failed"
    assert in_process.get("/health").status_code == 200
    after = in_process.post(
        "/v1/chat/completions",
        json={"messages": HI, "max_tokens": 3, "temperature": 0, "ignore_eos": True},
    )
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3
    deadline = time.monotonic() + 10
    while in_process.app.state.server.engine.stats().kv_usage > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    # the failed requests' blocks are free
    assert in_process.app.state.server.engine.stats().kv_usage == 0


def test_client_gone_in_the_middle_of_its_body_is_one_log_line(
    in_process: TestClient, caplog: pytest.LogCaptureFixture
):
    messages = iter(
        [
            {"type": "http.request", "body": b'{"messages": [{"role": "us', "more_body": True},
            {"type": "http.disconnect"},
        ]
    )
    sent: list[dict] = []

    async def receive() -> dict:
        return next(messages)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"testserver"),
            (b"content-type", b"application/json"),
            (b"content-length", b"5000"),
        ],
        "client": ("127.0.0.1", 1234),
        "server": ("testserver", 80),
    }
    with caplog.at_level(logging.DEBUG):
        in_process.portal.call(in_process.app, scope, receive, send)
    records = [
        r
        for r in caplog.records
        if r.levelno >= logging.INFO
        and r.name.startswith(("app", "starlette", "uvicorn", "pagedchat"))
    ]
    # the access line: 499, no traceback
    assert len(records) == 1, [r.getMessage() for r in records]
    assert (
        records[0].getMessage() == "POST /v1/chat/completions 499" and records[0].exc_info is None
    )
    assert all(r.exc_info is None for r in caplog.records)
    assert sent[0]["status"] == 499


# the engine's death ends the process (a supervisor restarts it) --------------------------------------


def _serve_in_thread(settings: ServerSettings) -> tuple[Any, threading.Thread, dict[str, int]]:
    """``pagedchat serve``'s run loop (app.serve.run_server) on a thread of this process, so the test can reach the
    engine; returns the app, the thread and where its exit status lands once it returns."""
    app, result = create_app(settings), {}
    thread = threading.Thread(
        target=lambda: result.setdefault("status", run_server(app, settings)), daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 120
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{settings.port}/health", timeout=2).status_code == 200:
                return app, thread, result
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


@pytest.mark.parametrize("exit_on_death", [True, False])
def test_engine_death_exits_non_zero(exit_on_death: bool):
    settings = ServerSettings(
        port=free_port(),
        exit_on_engine_death=exit_on_death,
        session_store="memory",
        engine=EngineConfig(kv_cache_memory_gib=float(SMALL_KV_GIB)),
    )
    with one_torch_thread():
        app, thread, result = _serve_in_thread(settings)
        try:
            fail_model_after(app, 0)
            response = httpx.post(
                f"http://127.0.0.1:{settings.port}/v1/chat/completions",
                timeout=60,
                json={"messages": HI, "max_tokens": 8},
            )
            assert response.status_code == 503
            if exit_on_death:
                thread.join(30)
                assert not thread.is_alive() and result["status"] == ENGINE_DIED != 0
                return
            deadline = time.monotonic() + 30
            while not app.state.engine_died and time.monotonic() < deadline:
                time.sleep(0.05)
            assert app.state.engine_died, "the watcher never saw the death"
            thread.join(1.0)  # (time to stop, had it been asked to)
            assert thread.is_alive()
            assert (
                httpx.get(f"http://127.0.0.1:{settings.port}/health", timeout=10).status_code == 503
            )
        finally:
            if thread.is_alive():
                app.state.request_shutdown()
                thread.join(30)
    assert result["status"] == 0  # stopped by hand: a normal exit
