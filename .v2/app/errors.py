"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the matching status.

Every failure the server reports goes through APIError, so clients (the openai package included) read one
format; ``param`` names the offending field where there is one.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}
# pydantic's wording for a broken bound, in the engine's ("must be >= 0"), with the bound from the error's context
_BOUNDS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

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
        errors = exc.errors(include_url=False)
        first = min(errors, key=_specificity)
        path = _field_path(first["loc"])
        msg = _message(first)
        field, sep, rest = msg.partition(": ")
        if sep and field.isidentifier():  # our own messages name the field they are about
            path, msg = path + [field], rest
        param = ".".join(path) or None
        message = f"{param}: {msg}" if param else msg
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problems)"
        return cls.bad_request(message, param)


def _specificity(error: dict[str, Any]) -> tuple[bool, int]:
    """A union reports each member's complaint: a broken constraint before "not a string", then the deepest one
    (``stop: at most 16 items`` rather than ``stop: a valid string`` for a list of 17)."""
    return error["type"].endswith("_type"), -len(error["loc"])


def _message(error: dict[str, Any]) -> str:
    bound = _BOUNDS.get(error["type"])
    if bound is not None:
        limit = next(iter(error.get("ctx", {}).values()), None)
        if isinstance(limit, float) and limit.is_integer():
            limit = int(limit)
        return f"must be {bound} {limit}"
    if error["type"] == "finite_number":
        return "must be a finite number"
    return error["msg"].removeprefix("Value error, ")


def _field_path(loc: tuple) -> list[str]:
    """The location without the union-member tags pydantic inserts (``str``, ``list[int]``, ``TextFormat``):
    clients know fields and indices, not our type annotations. A bad key of a map is the map's fault."""
    if "[key]" in loc:
        loc = loc[: loc.index("[key]") - 1]
    return [str(part) for part in loc if not isinstance(part, str) or _is_field_name(part)]


def _is_field_name(part: str) -> bool:
    return (
        part.isidentifier()
        and part.islower()
        and part not in {"str", "int", "float", "bool", "list", "dict"}
    )


class EngineUnavailable(APIError):
    def __init__(self, message: str = "the engine is not running; try again later") -> None:
        super().__init__(503, message, code="engine_unavailable", headers={"Retry-After": "5"})


async def engine_dead_handler(request: Request, exc: Exception) -> JSONResponse:
    """The engine stopped while a request waited for its answer."""
    return EngineUnavailable(f"the engine stopped: {exc}").response()


async def request_failed_handler(request: Request, exc: Exception) -> JSONResponse:
    """The engine ended this one request with an error of its own (the others, and the engine, run on)."""
    return APIError(500, f"the request failed: {exc}", code="request_failed").response()


async def client_gone_handler(request: Request, exc: Exception) -> Response:
    """Nobody reads this answer (the client disconnected and its request was aborted); 499 for the log."""
    return Response(status_code=499)


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404/405 in the same shape (a 405 keeps its ``Allow`` header)."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or "error"
    headers = dict(getattr(exc, "headers", None) or {})
    return APIError(
        status, f"{request.method} {request.url.path}: {detail}", headers=headers
    ).response()
