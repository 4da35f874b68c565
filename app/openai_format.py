"""OpenAI's response shapes, built from engine outputs: chat.completion(.chunk), text_completion, usage,
logprobs. Plain functions over plain data; the routes in openai_api.py decide when to send what."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from app.chat_format.reply_parser import ReplyParser
from engine.sample.token_logprobs import TokenLogprobs
from engine.output.outputs import Usage


@dataclass(slots=True)
class ResponseHeader:
    """The fields every chunk of one response repeats."""

    object: str  # chat.completion.chunk | chat.completion | text_completion
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    # stream_options.include_usage: every chunk carries "usage": null
    include_usage_field: bool = False
    return_token_ids: bool = False  # each choice carries its token ids

    @classmethod
    def new(
        cls,
        object_: str,
        model: str,
        prefix: str,
        include_usage_field: bool = False,
        return_token_ids: bool = False,
    ) -> ResponseHeader:
        return cls(
            object_,
            model,
            f"{prefix}-{uuid.uuid4().hex}",
            include_usage_field=include_usage_field,
            return_token_ids=return_token_ids,
        )

    def choice_ids(self, choice: dict[str, Any], token_ids: list[int]) -> dict[str, Any]:
        """``choice`` with its ``token_ids`` where the request asked for them."""
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def wrap(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        body = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage_body(usage)
        elif self.include_usage_field:
            body["usage"] = None
        return body


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def samples_usage(usages: list[Usage]) -> Usage:
    """The usage of one prompt's samples (n, best_of): the prompt counted once, every sample's completion tokens
    (what was generated: OpenAI's count, best_of's unreturned samples included)."""
    return Usage(
        usages[0].prompt_tokens, sum(u.completion_tokens for u in usages), usages[0].cached_tokens
    )


def sum_usage(usages: list[Usage]) -> Usage:
    """The usage of several prompts."""
    return Usage(
        sum(u.prompt_tokens for u in usages),
        sum(u.completion_tokens for u in usages),
        sum(u.cached_tokens for u in usages),
    )


def chat_choice_delta(
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    stop_reason: int | str | None = None,
) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return choice


def chat_choice_message(
    index: int,
    reply: ReplyParser,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None,
    stop_reason: int | str | None,
) -> dict[str, Any]:
    """A whole reply's message: its content (null when the reply is only tool calls, as OpenAI's), and its
    reasoning and tool calls where it has them."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": reply.content if reply.content or not reply.calls else None,
    }
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.calls:
        message["tool_calls"] = [call.message_call() for call in reply.calls]
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def completion_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None,
    stop_reason: int | str | None = None,
) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return choice


def logprob_token_ids(entries: list[TokenLogprobs]) -> list[int]:
    """Every token id whose text the logprobs of ``entries`` show (sampled and alternatives)."""
    ids: list[int] = []
    for entry in entries:
        ids.append(entry.token_id)
        ids.extend(token_id for token_id, _ in entry.top)
    return ids


def chat_logprobs(entries: list[TokenLogprobs], texts: dict[int, str]) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = texts[token_id]
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    return {
        "content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }


def completion_logprobs(
    entries: list[TokenLogprobs], texts: dict[int, str], offset: int
) -> dict[str, Any]:
    """The legacy completions shape; ``offset`` is where the first token's text starts in the choice text."""
    tokens, offsets = [], []
    for entry in entries:
        offsets.append(offset)
        tokens.append(texts[entry.token_id])
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(e.logprob) for e in entries],
        "top_logprobs": [{texts[t]: _finite(lp) for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def _finite(logprob: float) -> float:
    """JSON has no -inf; OpenAI-compatible servers send a large negative number instead."""
    return max(logprob, -9999.0)
