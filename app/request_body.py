"""Reading a request: a JSON body (415 for any other media type: a browser page on another site can send
``text/plain`` or a form without asking, but not ``application/json``), under a size cap, parsed into a pydantic
model (413 / 400 otherwise); and running a handler's work only as long as its client is still connected."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable
from typing import Annotated, TypeVar

import msgspec
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from app.errors import APIError
from app.protocol.fields import MAX_MESSAGES

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before the answer was ready; its request was aborted."""


async def read_model(request: Request, model: type[M], max_bytes: int) -> M:
    require_json(request)
    body = await read_body(request, max_bytes)
    if not body.strip():
        raise APIError.bad_request("the request body must be a JSON object")
    top = _top_level_fields(body)
    _check_counts(model, top)
    ids, top, body = (
        _set_token_ids_aside(top, body) if "prompt" in model.model_fields else (None, top, body)
    )
    schema, body = (
        _set_schema_aside(top, body) if "response_format" in model.model_fields else (None, body)
    )
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as exc:
        raise APIError.from_validation_error(exc) from None
    if ids is not None:
        parsed.prompt = ids
    spec = getattr(parsed.response_format, "json_schema", None) if schema is not None else None
    if spec is not None:
        spec._raw_schema = schema
    if top is not None:
        _note_unknown_fields(request.url.path, model, top)
    return parsed


def _set_token_ids_aside(
    top: dict[str, msgspec.Raw] | None, body: bytes
) -> tuple[list[int] | None, dict[str, msgspec.Raw] | None, bytes]:
    """A long prompt of token ids (at least LARGE_TOKEN_IDS_BYTES) decoded by msgspec, ``[0]`` in its place:
    pydantic holds the event loop ~0.5 s for the 500,000 ids of a 4 MiB body, msgspec a few milliseconds. Anything
    else (another shape, an id out of range, 5.0 for 5) leaves the body as it is, for pydantic."""
    raw = top.get("prompt") if top else None
    if raw is None or len(raw) < LARGE_TOKEN_IDS_BYTES or _PROMPT_LIST.match(raw):
        return None, top, body
    try:
        ids = _token_ids.decode(raw)
    except msgspec.DecodeError:  # (and its ValidationError)
        return None, top, body
    top = {**top, "prompt": msgspec.Raw(b"[0]")}
    return ids, top, msgspec.json.encode(top)


def _set_schema_aside(top: dict[str, msgspec.Raw] | None, body: bytes) -> tuple[str | None, bytes]:
    """A large ``response_format.json_schema.schema`` (an object of at least LARGE_SCHEMA_BYTES) taken out of the
    body as text, ``{}`` in its place: pydantic would build and check every value of it on the event loop (67 ms
    for 400,000 enum values), the grammar worker parses it anyway. Anything unexpected leaves the body as it is."""
    try:
        response_format = (
            _raw_object.decode(top["response_format"]) if top and "response_format" in top else None
        )
        spec = (
            _raw_object.decode(response_format["json_schema"])
            if response_format and "json_schema" in response_format
            else None
        )
    except msgspec.DecodeError:
        return None, body
    raw = spec.get("schema") if spec else None
    if raw is None or len(raw) < LARGE_SCHEMA_BYTES or not bytes(raw).lstrip().startswith(b"{"):
        return None, body
    spec["schema"] = msgspec.Raw(b"{}")
    response_format["json_schema"] = msgspec.Raw(msgspec.json.encode(spec))
    top = {**top, "response_format": msgspec.Raw(msgspec.json.encode(response_format))}
    return bytes(raw).decode(), msgspec.json.encode(top)


_WARNED: set[tuple[str, str]] = set()  # (route, field) already logged
_MAX_WARNED = 256  # a client inventing names cannot grow it (or the log) without bound
LARGE_SCHEMA_BYTES = 64 * 1024
# (values stay raw bytes: nothing built for them)
_raw_object = msgspec.json.Decoder(dict[str, msgspec.Raw])
_raw_list = msgspec.json.Decoder(list[msgspec.Raw])
# of one /v1/completions request (a batch; the most inputs OpenAI's embeddings take in one)
MAX_PROMPTS = 2048
# list fields counted before they are parsed: (the most items, what they are)
_COUNTED = {"messages": (MAX_MESSAGES, "messages"), "prompt": (MAX_PROMPTS, "prompts")}
# a list of texts or of token-id lists: several prompts
_PROMPT_LIST = re.compile(rb'\s*\[\s*["\[]')
LARGE_TOKEN_IDS_BYTES = 64 * 1024
# the range of app/protocol/fields.py's TokenId
_token_ids = msgspec.json.Decoder(list[Annotated[int, msgspec.Meta(ge=0, lt=2**31)]])


def _top_level_fields(body: bytes) -> dict[str, msgspec.Raw] | None:
    """The body's top-level fields, their values raw bytes (no Python objects built for them); None if the body is
    not a JSON object (pydantic says why)."""
    try:
        return _raw_object.decode(body)
    except msgspec.DecodeError:
        return None


def _check_counts(model: type[BaseModel], top: dict[str, msgspec.Raw] | None) -> None:
    """More items in a list field than its bound is a 400 before pydantic builds each one: 60,000 small messages
    would hold the event loop ~0.3 s before their count is checked, 400,000 one-letter prompts (2 MB) seconds to
    build and minutes to tokenize. A prompt of token ids is one prompt, however long."""
    if top is None:
        return
    for field, (most, items) in _COUNTED.items():
        if field not in top or field not in model.model_fields:
            continue
        if field == "prompt" and not _PROMPT_LIST.match(top[field]):
            continue  # one prompt of token ids (or not a list: pydantic says so)
        try:
            values = _raw_list.decode(top[field])
        except msgspec.DecodeError:
            continue  # (not a list: pydantic says so)
        if len(values) > most:
            raise APIError.bad_request(
                f"{field}: at most {most} {items} per request (got {len(values)})", param=field
            )


def _note_unknown_fields(path: str, model: type[BaseModel], top: dict[str, msgspec.Raw]) -> None:
    """A field the route does not know is ignored (as OpenAI and vLLM do); it is logged once per route and name,
    so an operator sees what clients send that has no effect."""
    if len(_WARNED) >= _MAX_WARNED:
        return
    known = model.model_fields
    for name in top:
        if name not in known and (path, name) not in _WARNED and len(_WARNED) < _MAX_WARNED:
            _WARNED.add((path, name))
            logger.warning(
                "%s: the field %r is not supported and was ignored (logged once)", path, name[:64]
            )


def require_json(request: Request) -> None:
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        shown = media_type or "none"
        raise APIError(
            415,
            f"Content-Type: the body must be application/json (got {shown})",
            param="Content-Type",
            code="unsupported_media_type",
        )


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    try:
        # a lying or absent Content-Length is caught while reading
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        logger.debug(
            "client went away while sending the body of %s %s (%d bytes read)",
            request.method,
            request.url.path,
            size,
        )
        raise ClientDisconnected() from None
    return b"".join(chunks)


def _too_large(max_bytes: int) -> APIError:
    return APIError(
        413,
        f"request body: larger than the server's limit of {max_bytes} bytes",
        code="request_too_large",
    )


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it (which aborts its engine request)
    and raise ClientDisconnected. For non-streaming answers, whose handler would otherwise run to the end."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
