"""/v1/presets: named system prompts, prefilled once on each replica and pinned in the KV cache, so a session
started with one hits its blocks on the first turn. The engine core keeps the pins (and says which it holds), so
every front process of a replica (``--api-server-count``) sees the same ones.

A preset belongs to the key that made it; the admin key (``--admin-api-key``) may make shared ones, which every
tenant sees. A preset is checked (its length against the context, and a real prefill) before it is stored, and a
stored one that cannot be prefilled any more (a smaller ``--max-model-len`` since) is skipped at start-up with a
log line: nothing stored can stop the server from starting.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.errors import APIError
from app.openapi import Operation
from app.protocol.sessions import CreatePresetRequest
from app.request_body import read_model
from app.sessions.service import SessionService
from app.sessions import conversation
from app.sessions.store import Preset, SessionStoreUnavailable, is_preset_name
from engine.async_engine import EngineDeadError

logger = logging.getLogger(__name__)


async def check_system(service: SessionService, system: str, param: str) -> list[int] | None:
    """400 for a system prompt over the size cap or one that leaves no room in the context; its tokens (None for
    a model without a tokenizer)."""
    cap = service.limits.max_system_prompt_chars
    if len(system) > cap:
        raise APIError.bad_request(
            f"{param}: the system prompt has {len(system)} characters, over this server's cap "
            f"of {cap} (--max-system-prompt-chars)",
            param,
        )
    if not service.prompts.has_tokenizer:
        return None
    ids = await service.prompts.in_thread(conversation.system_prefix_ids, system)
    if len(ids) >= service.max_model_len:
        raise APIError.bad_request(
            f"{param}: the system prompt is {len(ids)} tokens; this model's maximum context "
            f"length is {service.max_model_len} tokens, and a turn needs room after it",
            param,
        )
    return ids


async def visible_preset(service: SessionService, name: str, tenant: str, param: str) -> Preset:
    preset = await service.store.get_preset(name, tenant) if is_preset_name(name) else None
    if preset is None:
        raise APIError.bad_request(f"{param}: no preset named {name!r}", param)
    return preset


async def pin_preset(
    service: SessionService, preset: Preset, param: str = "system"
) -> tuple[int, int]:
    """Prefill the preset's system prompt once on this replica and pin its full blocks (capped at
    ``preset_pin_share`` of the pool); returns (prompt tokens, pinned blocks). 400 when it cannot be prefilled."""
    pin_id = _pin_id(preset)
    pins = await service.engine.pins()
    if (held := pins.get(pin_id)) is not None:
        return held
    ids = await check_system(service, preset.system, param)
    if ids is None:
        raise APIError.bad_request(f"{param}: presets need a model with a tokenizer", param)
    limits = service.limits
    # all pins hold at most preset_pin_share of the KV pool, one key's own presets preset_pin_share_per_key
    group = None if preset.shared else f"key:{preset.owner}"
    try:
        pinned = (
            await service.engine.pin_prefix(
                pin_id, ids, None, limits.preset_pin_share, group, limits.preset_pin_share_per_key
            )
            if len(ids) > 1
            else 0
        )
    except ValueError as exc:
        raise APIError.bad_request(
            f"{param}: the engine refused the preset: {exc}", param
        ) from None
    logger.info("preset %r: %d tokens, %d blocks pinned", preset.key, len(ids), pinned)
    return len(ids), pinned


def pin_stored_presets_later(service: SessionService) -> asyncio.Task:
    """At start-up, in the background: the server answers at once, however many presets are stored (each also
    pins on its first use, in pin_preset). The caller cancels the task at shutdown."""
    return asyncio.get_running_loop().create_task(
        pin_stored_presets(service), name="pagedchat-preset-pins"
    )


async def pin_stored_presets(service: SessionService) -> None:
    """Every stored preset pinned, or skipped with a log line if it cannot be."""
    try:
        stored = await service.store.list_presets(None)
    except SessionStoreUnavailable as exc:
        logger.warning("stored presets not pinned now (%s): each pins on its first use", exc)
        return
    if stored:
        logger.info("pinning %d stored presets in the background", len(stored))
    for preset in stored:
        try:
            await pin_preset(service, preset)
        except EngineDeadError:
            return  # (the server's engine watcher handles its death)
        except Exception as exc:  # noqa: BLE001 - a stored object must never stop the server from starting
            message = exc.message if isinstance(exc, APIError) else repr(exc)
            logger.warning("preset %r skipped: it cannot be prefilled (%s)", preset.key, message)


async def _unpin(service: SessionService, preset: Preset) -> None:
    await service.engine.unpin_prefix(_pin_id(preset))


def _pin_id(preset: Preset) -> str:
    return f"preset:{preset.key}"


async def create_preset(request: Request) -> JSONResponse:
    service: SessionService = request.app.state.server.sessions
    body = await read_model(request, CreatePresetRequest, service.limits.max_request_bytes)
    if body.shared and not service.admission.is_admin(request):
        raise APIError(
            403,
            "shared: only the admin key (--admin-api-key) creates shared presets",
            param="shared",
            code="permission_denied",
        )
    preset = Preset(
        body.name, body.system, owner="" if body.shared else service.admission.tenant(request)
    )
    cap = service.limits.max_presets_per_key
    if cap and not preset.shared:
        own = sum(p.owner == preset.owner for p in await service.store.list_presets(preset.owner))
        if own >= cap:
            raise APIError(
                429,
                f"name: this API key already has {own} presets (--max-presets-per-key {cap}); "
                "delete some first",
                param="name",
                code="preset_quota_exceeded",
            )
    existing = await service.store.get_preset(preset.name, preset.owner)
    if existing is not None and existing.key == preset.key:
        raise APIError(
            409, f"preset {body.name!r} exists; delete it first", param="name", code="preset_exists"
        )
    # checked (and prefilled) before it is stored
    num_tokens, pinned = await pin_preset(service, preset)
    if not await service.store.save_preset(preset):
        await _unpin(service, preset)
        raise APIError(
            409, f"preset {body.name!r} exists; delete it first", param="name", code="preset_exists"
        )
    return JSONResponse(preset.public(num_tokens, pinned), status_code=201)


async def list_presets(request: Request) -> JSONResponse:
    service: SessionService = request.app.state.server.sessions
    presets = await service.store.list_presets(service.admission.tenant(request))
    pins = await service.engine.pins()
    return JSONResponse(
        {"object": "list", "data": [p.public(*pins.get(_pin_id(p), (None, None))) for p in presets]}
    )


async def presets_root(request: Request) -> Response:
    return await (create_preset(request) if request.method == "POST" else list_presets(request))


async def delete_preset(request: Request) -> JSONResponse:
    service: SessionService = request.app.state.server.sessions
    name = request.path_params["name"]
    preset = (
        await service.store.get_preset(name, service.admission.tenant(request))
        if is_preset_name(name)
        else None
    )
    if preset is None:
        raise APIError(404, f"preset {name!r} not found", param="name", code="preset_not_found")
    if preset.shared and not service.admission.is_admin(request):
        raise APIError(
            403,
            f"preset {name!r} is shared: only the admin key deletes it",
            param="name",
            code="permission_denied",
        )
    await service.store.delete_preset(preset)
    await _unpin(service, preset)
    return JSONResponse({"name": name, "object": "preset.deleted", "deleted": True})


routes = [
    Route("/v1/presets", presets_root, methods=["GET", "POST"]),
    Route("/v1/presets/{name}", delete_preset, methods=["DELETE"]),
]
OPERATIONS = [
    Operation(
        "/v1/presets",
        "POST",
        "Create a preset (a system prompt, pinned in the KV cache)",
        CreatePresetRequest,
        status=201,
    ),
    Operation("/v1/presets", "GET", "Presets: this key's own and the shared ones"),
    Operation(
        "/v1/presets/{name}", "DELETE", "Delete a preset", path_params={"name": "the preset's name"}
    ),
]
