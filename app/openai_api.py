"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions (streaming over SSE or not), /v1/models and
/v1/models/{model}."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.openai_format import (
    ResponseHeader,
    completion_choice,
    completion_logprobs,
    samples_usage,
    sum_usage,
)
from app.protocol.completions import ChatCompletionRequest, CompletionRequest
from app.replies import ReplyWriter
from app.request_body import cancel_on_disconnect, read_model
from app.request_budget import check_least_tokens
from app.serving import Serving
from app.sse import sse_response
from app.timed_stream import TimedStream
from engine.output.outputs import RequestOutput, best_choices


async def chat_completions(request: Request) -> Response:
    server: Serving = request.app.state.server
    arrival = time.monotonic()
    body = await read_model(request, ChatCompletionRequest, server.max_request_bytes)
    server.admission.check_model(body.model)
    if session_id := body.session_id or request.headers.get("x-session-id"):
        return await server.session_chat(request, server.sessions, body, session_id, arrival)
    replies, admission = server.replies, server.admission
    prompt_ids, params, plan = await replies.prepare_chat(body)
    stream = await admission.submit(
        prompt_ids,
        params,
        admission.cache_salt(request, body.cache_salt),
        arrival,
        request,
        body.priority,
    )
    stream.reply_plan = plan
    return await replies.answer_chat(request, body, stream)


# completions ------------------------------------------------------------------------------------------


async def completions(request: Request) -> Response:
    """Each prompt's ``n`` choices are numbered ``prompt * n + sample`` (OpenAI's and vLLM's order)."""
    server: Serving = request.app.state.server
    arrival = time.monotonic()
    body = await read_model(request, CompletionRequest, server.max_request_bytes)
    model = server.admission.check_model(body.model)
    given = body.prompts()
    # the budget's bound from below before the tokenizer sees a prompt (app/request_budget.py)
    check_least_tokens(body, given, server.replies.max_request_tokens)
    prompts = await server.prompts.encode_each(given)
    params = server.replies.sampling_params_each(body, [len(ids) for ids in prompts])
    admission = server.admission
    salt = admission.cache_salt(request, body.cache_salt)
    # the key's quotas: one reservation for every prompt (app/key_quota.py)
    ticket = admission.reserve(request, [len(ids) for ids in prompts], params)
    streams: list[TimedStream] = []
    try:
        for ids, p in zip(prompts, params):
            streams.append(
                await admission.submit(ids, p, salt, arrival, request, body.priority, ticket=ticket)
            )
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    echoes = await server.prompts.decode_each(prompts) if body.echo else [""] * len(prompts)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    header = ResponseHeader.new(
        "text_completion",
        model,
        "cmpl",
        include_usage and body.stream,
        body.return_token_ids,
    )
    if body.stream:
        return sse_response(
            _completion_chunks(server.replies, header, streams, echoes, body.n, include_usage)
        )
    results = await cancel_on_disconnect(request, asyncio.gather(*(s.collect() for s in streams)))
    choices = []
    for prompt, finals in enumerate(results):
        kept = best_choices(finals, body.n) if body.best_of is not None else finals
        for out in kept:
            logprobs = await _completion_logprobs(server.replies, out.logprobs, len(echoes[prompt]))
            choices.append(
                header.choice_ids(
                    completion_choice(
                        prompt * body.n + out.index,
                        echoes[prompt] + out.text,
                        out.finish_reason,
                        logprobs,
                        out.stop_reason,
                    ),
                    out.token_ids,
                )
            )
    usage = sum_usage([samples_usage([out.usage for out in finals]) for finals in results])
    return JSONResponse(header.wrap(choices, usage))


async def _completion_chunks(
    replies: ReplyWriter,
    header: ResponseHeader,
    streams: list[TimedStream],
    echoes: list[str],
    n: int,
    include_usage: bool,
) -> AsyncIterator[dict[str, Any]]:
    """Choice ``prompt * n + sample`` (a streamed best_of equals n: protocol/completions.py), each one's chunks as
    they come."""
    offsets = [len(echoes[i // n]) for i in range(len(streams) * n)]  # per choice
    finals: dict[int, RequestOutput] = {}
    for i in range(len(offsets)):
        if echoes[i // n]:
            yield header.wrap([completion_choice(i, echoes[i // n], None, None)])
    async for prompt, out in _merge(streams):
        i = prompt * n + out.index
        logprobs = await _completion_logprobs(replies, out.logprobs_delta, offsets[i])
        offsets[i] += len(out.text_delta)
        if replies.worth_a_chunk(header, out, logprobs):
            choice = completion_choice(
                i, out.text_delta, out.finish_reason, logprobs, out.stop_reason
            )
            yield header.wrap([header.choice_ids(choice, out.token_ids_delta)])
        if out.finished:
            finals[i] = out
    if include_usage:
        per_prompt = [
            [finals[i].usage for i in range(p * n, (p + 1) * n)] for p in range(len(streams))
        ]
        yield header.wrap([], sum_usage([samples_usage(usages) for usages in per_prompt]))


async def _completion_logprobs(
    replies: ReplyWriter, entries: list | None, offset: int
) -> dict[str, Any] | None:
    if not entries:
        return None
    return completion_logprobs(entries, await replies.token_texts(entries), offset)


async def _merge(streams: list[TimedStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index; all closed at the end. One
    stream (the common case) is read directly: no task and no second queue per token."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: TimedStream) -> None:
        try:
            async for out in stream:
                merged.put_nowait((index, out))
        except Exception as exc:  # noqa: BLE001 - re-raised by the reader
            merged.put_nowait((index, exc))
        else:
            merged.put_nowait((index, None))  # every sample of this stream has ended

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            index, item = await merged.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                remaining -= 1
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
        for stream in streams:
            await stream.aclose()


# models -----------------------------------------------------------------------------------------------


async def list_models(request: Request) -> JSONResponse:
    """One card per name the model is served as (--served-model-name), the primary first."""
    server: Serving = request.app.state.server
    cards = [_model_card(server, name) for name in server.served_names]
    return JSONResponse({"object": "list", "data": cards})


async def retrieve_model(request: Request) -> JSONResponse:
    """``GET /v1/models/{model}`` (the openai client's ``models.retrieve``): the card, or 404 for another name."""
    server: Serving = request.app.state.server
    return JSONResponse(
        _model_card(server, server.admission.check_model(request.path_params["model_id"]))
    )


def _model_card(server: Serving, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": server.started,
        "owned_by": "pagedchat",
        "root": server.engine.info.model_id,
        "max_model_len": server.max_model_len,
    }


routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
]
