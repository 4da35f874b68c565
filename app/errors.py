"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the matching status.

Every failure the server reports goes through APIError, so clients (the openai package included) read one
format; ``param`` names the offending field where there is one.
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error",
          409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> APIError:
        return cls(400, message, param=param, code="invalid_value" if param else None)

    @classmethod
    def from_value_error(cls, exc: ValueError) -> APIError:
        """Engine validation errors read ``"field: message"``; the field becomes ``param``."""
        text = str(exc)
        field, sep, _ = text.partition(": ")
        param = field if sep and field.replace("_", "").replace(".", "").isalnum() else None
        return cls.bad_request(text, param)

    @classmethod
    def from_validation_error(cls, exc: ValidationError) -> APIError:
        """The first problem, named by its path (``messages.0.role``); our own validators' messages start
        with the field they are about."""
        first = exc.errors(include_url=False)[0]
        path = _field_path(first["loc"])
        msg = first["msg"].removeprefix("Value error, ")
        field, sep, rest = msg.partition(": ")
        if first["type"] == "value_error" and sep and field.isidentifier():
            path, msg = path + [field], rest
        param = ".".join(path) or None
        message = f"{param}: {msg}" if param else msg
        if len(exc.errors()) > 1:
            message += f" (and {len(exc.errors()) - 1} more problems)"
        return cls.bad_request(message, param)


def _field_path(loc: tuple) -> list[str]:
    """The location up to the first union-member tag pydantic inserts (``str``, ``list[int]``, ``TextPart``):
    clients know fields and indices, not our type annotations."""
    path = []
    for part in loc:
        if isinstance(part, str) and not _is_field_name(part):
            break
        path.append(str(part))
    return path


def _is_field_name(part: str) -> bool:
    return part.isidentifier() and part.islower() and part not in {"str", "int", "float", "bool", "list", "dict"}


class EngineUnavailable(APIError):
    def __init__(self, message: str = "the engine is not running; try again later") -> None:
        super().__init__(503, message, code="engine_unavailable", headers={"Retry-After": "5"})


async def engine_dead_handler(request: Request, exc: Exception) -> JSONResponse:
    """The engine stopped while a request waited for its answer."""
    return EngineUnavailable(f"the engine stopped: {exc}").response()


async def client_gone_handler(request: Request, exc: Exception) -> Response:
    """Nobody reads this answer (the client disconnected and its request was aborted); 499 for the log."""
    return Response(status_code=499)


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404/405 in the same shape."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or "error"
    return APIError(status, f"{request.method} {request.url.path}: {detail}").response()
