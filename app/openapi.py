"""``GET /openapi.json``: the OpenAPI document, with request bodies generated from the pydantic models."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse

_ERROR = {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_ERROR_SCHEMA = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "null"]}}, "required": ["message", "type", "param", "code"]}}}


@dataclass(frozen=True, slots=True)
class Operation:
    path: str
    method: str
    summary: str
    body: type[BaseModel] | None = None
    streams: bool = False  # answers text/event-stream when the body asks for it


def openapi_document(operations: list[Operation], title: str, version: str) -> dict[str, Any]:
    models = {op.body for op in operations if op.body is not None}
    refs, schema = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
                                      ref_template="#/components/schemas/{model}")
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        entry: dict[str, Any] = {"summary": op.summary, "responses": {"200": _ok(op.streams), "default": _ERROR}}
        if op.body is not None:
            entry["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": refs[(op.body, "validation")]}}}
        paths.setdefault(op.path, {})[op.method.lower()] = entry
    components = {**schema.get("$defs", {}), "Error": _ERROR_SCHEMA}
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": components}}


def _ok(streams: bool) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {}}
    if streams:
        content["text/event-stream"] = {}
    return {"description": "success", "content": content}


async def openapi_endpoint(request: Request) -> JSONResponse:
    return JSONResponse(request.app.state.openapi)
