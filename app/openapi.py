"""``GET /openapi.json``: the OpenAPI document, with request bodies generated from the pydantic models, and the
path and query parameters each operation takes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse

_ERROR = {
    "description": "error",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
}
_ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
}
_PATH_PARAM = re.compile(r"{([a-z_]+)}")
# what each path parameter looks like (anything else is a 404)
PATH_PARAMS = {
    "session_id": {"type": "string", "pattern": "^[A-Za-z0-9_-]{22}$"},
    "response_id": {"type": "string", "pattern": "^resp_[A-Za-z0-9_-]{1,64}$"},
    "name": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"},
    "model_id": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"},
}


@dataclass(frozen=True, slots=True)
class QueryParam:
    name: str
    schema: dict[str, Any]
    description: str = ""


@dataclass(frozen=True, slots=True)
class Operation:
    path: str
    method: str
    summary: str
    body: type[BaseModel] | None = None
    streams: bool = False  # answers text/event-stream when the body asks for it
    status: int = 200  # the status of success
    content_type: str = "application/json"  # of a successful answer
    other_types: tuple[str, ...] = ()  # of a successful answer the request asks for otherwise
    path_params: dict[str, str] = field(default_factory=dict)  # name -> description
    query: list[QueryParam] = field(default_factory=list)


def openapi_document(operations: list[Operation], title: str, version: str) -> dict[str, Any]:
    models = {op.body for op in operations if op.body is not None}
    refs, schema = models_json_schema(
        [(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
        ref_template="#/components/schemas/{model}",
    )
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        entry: dict[str, Any] = {
            "summary": op.summary,
            "responses": {str(op.status): _ok(op), "default": _ERROR},
        }
        parameters = _parameters(op)
        if parameters:
            entry["parameters"] = parameters
        if op.body is not None:
            entry["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": refs[(op.body, "validation")]}},
            }
        paths.setdefault(op.path, {})[op.method.lower()] = entry
    components = {**schema.get("$defs", {}), "Error": _ERROR_SCHEMA}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }


def _parameters(op: Operation) -> list[dict[str, Any]]:
    params = [
        {
            "name": name,
            "in": "path",
            "required": True,
            "description": op.path_params.get(name, ""),
            "schema": PATH_PARAMS.get(name, {"type": "string"}),
        }
        for name in _PATH_PARAM.findall(op.path)
    ]
    return params + [
        {
            "name": q.name,
            "in": "query",
            "required": False,
            "description": q.description,
            "schema": q.schema,
        }
        for q in op.query
    ]


def _ok(op: Operation) -> dict[str, Any]:
    content: dict[str, Any] = {
        op.content_type: {"schema": {"type": "string"}}
        if op.content_type.startswith("text/")
        else {}
    }
    if op.streams:
        content["text/event-stream"] = {}
    for other in op.other_types:
        content[other] = {"schema": {"type": "string"}}
    return {"description": "success", "content": content}


async def openapi_endpoint(request: Request) -> JSONResponse:
    return JSONResponse(request.app.state.openapi)
