"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes): what the model's tokenizer and chat template make of
a prompt, and the text of token ids. They run on the tokenizer thread (never the event loop), take the request
body cap, and need an API key like /v1/ routes."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from app.errors import APIError
from app.openapi import Operation
from app.protocol.tokenization import DetokenizeRequest, TokenizeRequest
from app.request_body import read_model
from app.serving import Serving


async def tokenize(request: Request) -> JSONResponse:
    server: Serving = request.app.state.server
    body = await read_model(request, TokenizeRequest, server.max_request_bytes)
    server.admission.check_model(body.model)
    if body.messages is not None:
        ids = await server.replies.render_chat(body.messages)
    else:
        ids = await server.prompts.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    answer = {
        "count": len(ids),
        "max_model_len": server.max_model_len,
        "tokens": ids,
        "token_strs": None,
    }
    if body.return_token_strs:
        answer["token_strs"] = await server.prompts.convert_ids_to_tokens(ids)
    return JSONResponse(answer)


async def detokenize(request: Request) -> JSONResponse:
    server: Serving = request.app.state.server
    body = await read_model(request, DetokenizeRequest, server.max_request_bytes)
    server.admission.check_model(body.model)
    vocab = server.engine.info.vocab_size
    if any(token >= vocab for token in body.tokens):
        raise APIError.bad_request(
            f"tokens: every id must be below the vocabulary size ({vocab})", "tokens"
        )
    return JSONResponse({"prompt": await server.prompts.decode(body.tokens)})


routes = [
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
]
OPERATIONS = [
    Operation(
        "/tokenize",
        "POST",
        "Token ids of a prompt or of chat messages (vLLM's /tokenize)",
        TokenizeRequest,
    ),
    Operation(
        "/detokenize", "POST", "The text of token ids (vLLM's /detokenize)", DetokenizeRequest
    ),
]
PROTECTED_PATHS = ("/tokenize", "/detokenize")  # like /v1/: an API key when the server has keys
