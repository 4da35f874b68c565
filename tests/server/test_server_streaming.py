"""Streaming over SSE against a running server, read raw with httpx: OpenAI's chunk shapes, usage and cached
tokens, stop strings held back, many concurrent streams, clients that leave (their KV blocks are freed) and a
full queue (429)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import pytest

from tests.server_harness import (
    RunningServer,
    offline_chat,
    offline_llm,
    read_until_content,
    server_fixture,
    sse_chunks,
    sse_data,
    wait_for_metrics,
    wait_until_idle,
)

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 20

server = server_fixture()
queue_server = server_fixture("--max-num-seqs", "1", "--max-queue", "1")

SEA = [{"role": "user", "content": "Write one sentence about the sea."}]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def chat_body(messages: list[dict[str, str]], **fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": messages,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        **fields,
    }


def stream_chunks(server: RunningServer, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST with ``stream: true``; the JSON chunks, after checking the response is an SSE stream ending in
    ``[DONE]``."""
    with httpx.stream(
        "POST", server.url(route), json={**body, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        return sse_chunks(sse_data(response.iter_lines()))


def post(server: RunningServer, route: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.url(route), json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def content_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def num_chat_prompt_tokens(messages: list[dict[str, str]]) -> int:
    return len(offline_llm().chat_prompt_ids(messages))


# chunk shapes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("messages", [SEA, FRANCE], ids=["length", "eos"])
def test_chat_stream_has_openai_chunk_shapes(server: RunningServer, messages):
    expected = offline_chat(messages, temperature=0.0, max_tokens=MAX_TOKENS)
    chunks = stream_chunks(server, "/v1/chat/completions", chat_body(messages))
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert {c["model"] for c in chunks} == {MODEL}
    assert all(len(c["choices"]) == 1 and c["choices"][0]["index"] == 0 for c in chunks)
    first, rest = chunks[0]["choices"][0], [c["choices"][0] for c in chunks[1:]]
    assert first["delta"] == {"role": "assistant", "content": ""} and first["finish_reason"] is None
    assert all(set(choice["delta"]) <= {"content"} for choice in rest)
    assert [choice["finish_reason"] for choice in rest] == [None] * (len(rest) - 1) + [
        expected.finish_reason
    ]
    assert content_of(chunks) == expected.text
    assert not any("usage" in c and c["usage"] is not None for c in chunks)


def test_streamed_content_equals_the_non_streamed_message(server: RunningServer):
    whole = post(server, "/v1/chat/completions", chat_body(SEA))
    chunks = stream_chunks(server, "/v1/chat/completions", chat_body(SEA))
    assert content_of(chunks) == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_include_usage_adds_a_final_chunk_with_the_token_counts(server: RunningServer):
    expected = offline_chat(SEA, temperature=0.0, max_tokens=MAX_TOKENS)
    chunks = stream_chunks(
        server, "/v1/chat/completions", chat_body(SEA, stream_options={"include_usage": True})
    )
    *with_choices, last = chunks
    # OpenAI: "usage": null until the end
    assert all(c["choices"] and c["usage"] is None for c in with_choices)
    assert last["choices"] == []
    prompt_tokens, completion_tokens = num_chat_prompt_tokens(SEA), len(expected.token_ids)
    usage = last["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        prompt_tokens,
        completion_tokens,
        prompt_tokens + completion_tokens,
    )
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < prompt_tokens


def test_completion_stream_has_openai_chunk_shapes(server: RunningServer):
    prompt = "The three primary colours are"
    body = {
        "model": MODEL,
        "prompt": prompt,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "stream_options": {"include_usage": True},
    }
    whole = post(server, "/v1/completions", body)
    chunks = stream_chunks(server, "/v1/completions", body)
    *with_choices, last = chunks
    assert {c["object"] for c in chunks} == {"text_completion"} and len(
        {c["id"] for c in chunks}
    ) == 1
    assert "".join(c["choices"][0]["text"] for c in with_choices) == whole["choices"][0]["text"]
    reasons = [c["choices"][0]["finish_reason"] for c in with_choices]
    assert reasons == [None] * (len(reasons) - 1) + [whole["choices"][0]["finish_reason"]]
    assert (
        last["choices"] == []
        and last["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    )
    assert last["usage"]["prompt_tokens"] == len(offline_llm().tokenizer.encode(prompt))


def test_repeated_long_prompt_reports_cached_tokens(server: RunningServer):
    """A prompt of several 16-token blocks, sent twice: the second time every full block but the one holding
    the last prompt token comes from the prefix cache (at least one prompt token is always computed)."""
    system = (
        "You are the harbour master of a small fishing town. You know every boat, its captain, its "
        "catch and its troubles, and you answer visitors patiently and precisely. "
    ) * 3
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Which boat left first?"},
    ]
    prompt_tokens = num_chat_prompt_tokens(messages)
    assert prompt_tokens > 4 * 16
    body = chat_body(messages, max_tokens=4, stream_options={"include_usage": True})
    first = stream_chunks(server, "/v1/chat/completions", body)[-1]["usage"]
    second = stream_chunks(server, "/v1/chat/completions", body)[-1]["usage"]
    assert first["prompt_tokens"] == second["prompt_tokens"] == prompt_tokens
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == 16 * ((prompt_tokens - 1) // 16)
    third = post(server, "/v1/chat/completions", chat_body(messages, max_tokens=4))["usage"]
    assert third["prompt_tokens_details"]["cached_tokens"] == 16 * ((prompt_tokens - 1) // 16)


# stop strings --------------------------------------------------------------------------------------


def straddling_stop_string() -> tuple[str, str]:
    """A stop string the greedy answer to SEA contains, spanning the boundary between two of its tokens (so
    a writer that sends each token's text as soon as it is decoded would leak its first half), and the
    answer's text. Found in whatever answer this CPU's greedy decoding gives: five characters on one line,
    two before the first boundary past the second token where they occur first."""
    expected = offline_chat(SEA, temperature=0.0, max_tokens=MAX_TOKENS)
    tokenizer = offline_llm().tokenizer
    text = expected.text
    for end in range(2, len(expected.token_ids)):
        boundary = len(tokenizer.decode(expected.token_ids[:end], skip_special_tokens=True))
        stop = text[boundary - 2 : boundary + 3]
        if (
            boundary >= 2
            and len(stop) == 5
            and "\n" not in stop
            and text.index(stop) == boundary - 2
        ):
            return stop, text
    pytest.fail(f"no stop string straddles a token boundary in the answer {text!r}")


def test_stop_string_never_appears_in_the_stream(server: RunningServer):
    stop, full_text = straddling_stop_string()
    chunks = stream_chunks(
        server, "/v1/chat/completions", chat_body(SEA, stop=["no such text", stop])
    )
    text = content_of(chunks)
    assert stop not in text
    assert text == full_text[: full_text.index(stop)]
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == stop


def test_stop_string_cuts_the_non_streamed_answer_too(server: RunningServer):
    stop, full_text = straddling_stop_string()
    reply = post(server, "/v1/chat/completions", chat_body(SEA, stop=stop))
    assert reply["choices"][0]["message"]["content"] == full_text[: full_text.index(stop)]
    assert reply["choices"][0]["finish_reason"] == "stop"


def test_include_stop_str_in_output_keeps_the_stop_string(server: RunningServer):
    stop, full_text = straddling_stop_string()
    chunks = stream_chunks(
        server, "/v1/chat/completions", chat_body(SEA, stop=stop, include_stop_str_in_output=True)
    )
    assert content_of(chunks) == full_text[: full_text.index(stop) + len(stop)]


# concurrency and disconnects -----------------------------------------------------------------------


NUM_STREAMS, NUM_CLOSED, CHUNKS_BEFORE_CLOSING = 32, 10, 3


async def read_stream(client: httpx.AsyncClient, index: int, close_early: bool) -> dict[str, Any]:
    """One chat stream; with ``close_early`` the client reads a few content chunks and hangs up (its request
    asks for far more tokens than the test waits for, so only an abort can end it)."""
    body = {
        "messages": [{"role": "user", "content": f"Tell me fact number {index} about the ocean."}],
        "temperature": 0,
        "ignore_eos": True,
        "max_tokens": 400 if close_early else 16,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    lines: list[str] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            lines.append(line)
            num_events = sum(x.startswith("data: ") for x in lines)
            # the role chunk, then content chunks
            if close_early and num_events > CHUNKS_BEFORE_CLOSING:
                return {"closed": True}  # leaving the block closes the connection mid-stream
    return {"closed": False, "chunks": sse_chunks(sse_data(lines))}


async def test_concurrent_streams_complete_and_closed_ones_free_their_blocks(server: RunningServer):
    before = server.metrics()
    closed = set(range(0, 3 * NUM_CLOSED, 3))  # spread among the others
    limits = httpx.Limits(max_connections=NUM_STREAMS + 4)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=180, limits=limits) as client:
        results = await asyncio.gather(
            *(read_stream(client, i, i in closed) for i in range(NUM_STREAMS))
        )
    assert sum(r["closed"] for r in results) == NUM_CLOSED
    for result in results:
        if not result["closed"]:
            usage = result["chunks"][-1]["usage"]
            assert usage["completion_tokens"] == 16
            assert result["chunks"][-2]["choices"][0]["finish_reason"] == "length"
    after = wait_until_idle(server)
    assert after.finished("abort") - before.finished("abort") == NUM_CLOSED
    assert after.finished("length") - before.finished("length") == NUM_STREAMS - NUM_CLOSED


def test_non_streaming_client_that_gives_up_is_aborted(server: RunningServer):
    before = server.metrics()
    body = chat_body(SEA, max_tokens=1000, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url("/v1/chat/completions"), json=body, timeout=httpx.Timeout(30, read=1.5)
        )
    after = wait_until_idle(server)
    assert after.finished("abort") == before.finished("abort") + 1
    assert (
        after.value("pagedchat:generation_tokens_total")
        - before.value("pagedchat:generation_tokens_total")
        < 1000
    )


# a full queue --------------------------------------------------------------------------------------


def test_full_queue_answers_429_with_retry_after_and_recovers(queue_server: RunningServer):
    """One running sequence at most and one request allowed to wait: A runs, B waits, C is turned away."""
    long_body = chat_body(SEA, max_tokens=1000, ignore_eos=True, stream=True)
    url = queue_server.url("/v1/chat/completions")
    with contextlib.ExitStack() as streams:
        a = streams.enter_context(httpx.stream("POST", url, json=long_body, timeout=60))
        assert a.status_code == 200
        a_lines = a.iter_lines()  # kept referenced: a dropped line iterator closes the connection
        read_until_content(a_lines)
        b = streams.enter_context(httpx.stream("POST", url, json=long_body, timeout=60))
        assert b.status_code == 200  # headers sent: B was admitted and waits for the running slot
        c = httpx.post(url, json=chat_body(FRANCE), timeout=60)
        assert c.status_code == 429, c.text
        assert int(c.headers["retry-after"]) >= 1
        error = c.json()["error"]
        assert (
            error["type"] == "rate_limit_error"
            and error["code"] == "queue_full"
            and error["message"]
        )
        wait_for_metrics(
            queue_server, lambda m: (m.running, m.waiting) == (1, 1), "A running and B waiting"
        )
    wait_until_idle(queue_server)
    reply = httpx.post(url, json=chat_body(FRANCE), timeout=60)
    assert reply.status_code == 200
    assert (
        reply.json()["choices"][0]["message"]["content"]
        == offline_chat(FRANCE, temperature=0.0, max_tokens=MAX_TOKENS).text
    )
