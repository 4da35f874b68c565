"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions (streaming over SSE or not), /v1/models."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.answers import answer_chat, render_chat, sampling_params, token_texts, worth_a_chunk
from app.errors import APIError
from app.openai_format import ResponseHeader, completion_choice, completion_logprobs, sum_usage
from app.protocol import ChatCompletionRequest, CompletionRequest
from app.request_body import cancel_on_disconnect, read_model
from app.serving import Serving, TimedStream
from app.sessions.api import chat_in_session
from app.sse import sse_response
from engine.llm_engine import RequestOutput


async def chat_completions(request: Request) -> Response:
    server: Serving = request.app.state.server
    arrival = time.monotonic()
    body = await read_model(request, ChatCompletionRequest, server.settings.max_request_bytes)
    server.check_model(body.model)
    if server.sessions is not None and (session_id := body.session_id or request.headers.get("x-session-id")):
        return await chat_in_session(request, server, body, session_id, arrival)
    prompt_ids = await render_chat(server, body.messages)
    stream = server.submit(prompt_ids, sampling_params(server, body, len(prompt_ids)),
                           server.cache_salt(request, body.cache_salt), arrival)
    return await answer_chat(request, server, body, stream)


# completions ------------------------------------------------------------------------------------------


async def completions(request: Request) -> Response:
    server: Serving = request.app.state.server
    arrival = time.monotonic()
    body = await read_model(request, CompletionRequest, server.settings.max_request_bytes)
    server.check_model(body.model)
    prompts = [await _prompt_ids(server, prompt) for prompt in body.prompts()]
    params = [sampling_params(server, body, len(ids)) for ids in prompts]
    salt = server.cache_salt(request, body.cache_salt)
    streams: list[TimedStream] = []
    try:
        for ids, p in zip(prompts, params):
            streams.append(server.submit(ids, p, salt, arrival))
    except APIError:
        for stream in streams:
            await stream.aclose()
        raise
    echoes = [await server.prompts.decode(ids) if body.echo else "" for ids in prompts]
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    header = ResponseHeader.new("text_completion", server.model_name, "cmpl", include_usage and body.stream)
    if body.stream:
        return sse_response(_completion_chunks(server, header, streams, echoes, include_usage))
    finals = await cancel_on_disconnect(request, asyncio.gather(*(s.collect() for s in streams)))
    choices = [completion_choice(i, echoes[i] + out.text, out.finish_reason,
                                 await _completion_logprobs(server, out.logprobs, len(echoes[i])), out.stop_reason)
               for i, out in enumerate(finals)]
    return JSONResponse(header.wrap(choices, sum_usage([out.usage for out in finals])))


async def _prompt_ids(server: Serving, prompt: str | list[int]) -> list[int]:
    return await server.prompts.encode(prompt) if isinstance(prompt, str) else prompt


async def _completion_chunks(server: Serving, header: ResponseHeader, streams: list[TimedStream],
                             echoes: list[str], include_usage: bool) -> AsyncIterator[dict[str, Any]]:
    offsets = [len(e) for e in echoes]
    finals: dict[int, RequestOutput] = {}
    for i, echo in enumerate(echoes):
        if echo:
            yield header.wrap([completion_choice(i, echo, None, None)])
    async for i, out in _merge(streams):
        logprobs = await _completion_logprobs(server, out.logprobs_delta, offsets[i])
        offsets[i] += len(out.text_delta)
        if worth_a_chunk(server, out, logprobs):
            yield header.wrap([completion_choice(i, out.text_delta, out.finish_reason, logprobs, out.stop_reason)])
        if out.finished:
            finals[i] = out
    if include_usage:
        yield header.wrap([], sum_usage([finals[i].usage for i in sorted(finals)]))


async def _completion_logprobs(server: Serving, entries: list | None, offset: int) -> dict[str, Any] | None:
    if not entries:
        return None
    return completion_logprobs(entries, await token_texts(server, entries), offset)


async def _merge(streams: list[TimedStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index; all closed at the end."""
    merged: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()

    async def pump(index: int, stream: TimedStream) -> None:
        try:
            async for out in stream:
                merged.put_nowait((index, out))
        except Exception as exc:  # noqa: BLE001 - re-raised by the reader
            merged.put_nowait((index, exc))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            index, item = await merged.get()
            if isinstance(item, BaseException):
                raise item
            remaining -= item.finished
            yield index, item
    finally:
        for task in pumps:
            task.cancel()
        for stream in streams:
            await stream.aclose()


# models -----------------------------------------------------------------------------------------------


async def list_models(request: Request) -> JSONResponse:
    server: Serving = request.app.state.server
    card = {"id": server.model_name, "object": "model", "created": server.started, "owned_by": "pagedchat",
            "root": server.engine.config.model_id, "max_model_len": server.max_model_len}
    return JSONResponse({"object": "list", "data": [card]})


routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
]
