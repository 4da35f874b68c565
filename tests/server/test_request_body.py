"""Request bodies at the edge (app/request_body.py): a body of too many messages is refused before pydantic builds
each one, naming the field; a large schema is re-encoded for the grammar worker in milliseconds."""

from __future__ import annotations

import json
import time

import pytest
from pydantic import ValidationError
from starlette.requests import Request

from app.errors import APIError
from app.protocol.completions import ChatCompletionRequest
from app.protocol.fields import MAX_MESSAGES
from app.request_body import read_model


def request_with(body: bytes) -> Request:
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "query_string": b"",
    }
    return Request(scope, receive)


async def test_too_many_messages_are_refused_before_each_is_built():
    body = json.dumps({"messages": [{"role": "user", "content": "a"}] * 60_000}).encode()
    start = time.perf_counter()
    with pytest.raises(APIError) as refused:
        await read_model(request_with(body), ChatCompletionRequest, 8 * 2**20)
    elapsed = time.perf_counter() - start
    assert refused.value.status == 400 and refused.value.param == "messages"
    assert f"at most {MAX_MESSAGES}" in refused.value.message
    # pydantic builds every message before it says so (~280 ms here); timed on the same machine, so a busy one
    # slows both
    start = time.perf_counter()
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate_json(body)
    pydantic = time.perf_counter() - start
    assert elapsed < pydantic / 3, (
        f"{elapsed * 1e3:.0f} ms on the event loop, pydantic {pydantic * 1e3:.0f}"
    )


async def test_the_most_messages_allowed_are_read():
    body = json.dumps({"messages": [{"role": "user", "content": "a"}] * MAX_MESSAGES}).encode()
    parsed = await read_model(request_with(body), ChatCompletionRequest, 8 * 2**20)
    assert len(parsed.messages) == MAX_MESSAGES


async def test_a_large_schema_reaches_the_grammar_worker_as_the_same_json():
    schema = {
        "type": "object",
        "properties": {"x": {"enum": [f"välue-{i}" for i in range(50_000)]}},
    }
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "a"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "big", "schema": schema},
            },
        }
    ).encode()
    parsed = await read_model(request_with(body), ChatCompletionRequest, 8 * 2**20)
    assert json.loads(parsed.structured_output().schema) == schema


async def test_a_large_schema_under_another_format_type_is_ignored_as_before():
    schema = {"type": "object", "properties": {"x": {"enum": [f"v{i}" for i in range(20_000)]}}}
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "a"}],
            "response_format": {
                "type": "json_object",
                "json_schema": {"name": "big", "schema": schema},
            },
        }
    ).encode()
    parsed = await read_model(request_with(body), ChatCompletionRequest, 8 * 2**20)
    assert parsed.structured_output().kind == "json_object"


async def test_a_large_schema_that_is_not_an_object_is_still_a_400_naming_it():
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "a"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "big", "schema": ["x"] * 30_000},
            },
        }
    ).encode()
    with pytest.raises(APIError) as refused:
        await read_model(request_with(body), ChatCompletionRequest, 8 * 2**20)
    assert refused.value.status == 400 and "schema" in (refused.value.param or "")
