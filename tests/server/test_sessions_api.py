"""Sessions over HTTP against a real server and a real Redis: every turn's prompt extends the previous turn's
exact tokens (so it hits every full block of earlier turns), presets hit their pinned blocks on a session's first
turn, history survives a server restart, Redis outages give 503 on session routes only (and a turn ending while
Redis is away is reported, kept and stored when it returns), a preset that cannot be prefilled is never stored and
a stored one never stops a start, listings are paged, concurrent turns get 409.

Expected cached-token counts are worked out by hand: the engine caches full blocks of 16 tokens, so after a turn
of P prompt and C completion tokens the next turn can hit floor((P + C) / 16) * 16 of them."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import httpx
import pytest

from tests.redis_harness import RedisServer
from tests.server_harness import (
    RunningServer,
    free_port,
    running_server,
    server_command,
    server_env,
    sse_chunks,
    sse_data,
    wait_until_idle,
)

pytestmark = pytest.mark.slow

BLOCK = 16
SYSTEM = "You are a helpful assistant. Answer every question in one short, friendly sentence."
GREEDY = {"temperature": 0, "max_tokens": 24}


@pytest.fixture(scope="module")
def server(redis_server: RedisServer):
    with running_server("--redis-url", redis_server.url) as server:
        yield server


def post(server: RunningServer, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.url(path), json=body, timeout=120, **kwargs)


def new_session(server: RunningServer, **body) -> str:
    response = post(server, "/v1/sessions", body)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def say(server: RunningServer, session_id: str, content: str, **params) -> dict:
    response = post(
        server, f"/v1/sessions/{session_id}/messages", {"content": content, **GREEDY, **params}
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-session-id"] == session_id
    return response.json()


def stored(
    server: RunningServer, session_id: str, num_messages: int, timeout: float = 20.0
) -> dict:
    """The session once its last turn is stored (turns are written when their reply ends)."""
    deadline = time.monotonic() + timeout
    while True:
        body = httpx.get(server.url(f"/v1/sessions/{session_id}"), timeout=10).json()
        if len(body.get("messages", [])) >= num_messages or time.monotonic() > deadline:
            return body
        time.sleep(0.05)


def stateless_second_turn(
    server: RunningServer, question: str, answer: dict, follow_up: str
) -> dict:
    """The same second turn through /v1/chat/completions with the whole history (the stateless way)."""
    history = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
        {"role": "user", "content": follow_up},
    ]
    return post(server, "/v1/chat/completions", {"messages": history, **GREEDY}).json()


def test_second_turn_reuses_every_full_block_of_the_first_turn(server: RunningServer):
    session_id = new_session(server, system=SYSTEM)
    first = say(server, session_id, "What is the capital of France?")
    stored(server, session_id, 2)
    second = say(server, session_id, "And what is the capital of Italy?")
    turn_one = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert second["usage"]["prompt_tokens"] > turn_one
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == turn_one // BLOCK * BLOCK

    stateless = stateless_second_turn(
        server, "What is the capital of France?", first, "And what is the capital of Italy?"
    )
    assert (
        stateless["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
    )
    assert stateless["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"]

    body = stored(server, session_id, 4)
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user", "assistant"]
    assert body["messages"][3]["usage"]["cached_tokens"] == turn_one // BLOCK * BLOCK
    assert body["stats"]["num_turns"] == 2
    assert (
        body["stats"]["num_tokens"]
        == second["usage"]["prompt_tokens"] + second["usage"]["completion_tokens"]
    )
    assert body["title"] == "What is the capital of France?"


def test_streamed_session_reply_is_the_chat_writer_with_usage(server: RunningServer):
    session_id = new_session(server)
    with httpx.stream(
        "POST",
        server.url(f"/v1/sessions/{session_id}/messages"),
        timeout=120,
        json={
            "content": "Name a color.",
            **GREEDY,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as response:
        assert response.status_code == 200 and response.headers["x-session-id"] == session_id
        payloads = [
            line.removeprefix("data: ")
            for line in response.iter_lines()
            if line.startswith("data: ")
        ]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    body = stored(server, session_id, 2)
    assert body["messages"][1]["content"] == text
    assert (
        body["messages"][1]["usage"]["completion_tokens"]
        == chunks[-1]["usage"]["completion_tokens"]
    )
    assert body["messages"][1]["timing"]["ttft_s"] > 0


def test_preset_first_turn_hits_the_pinned_preset_blocks(server: RunningServer, tokenizer):
    system = "You are Captain Byte, a pirate who explains computers. " * 4
    created = post(server, "/v1/presets", {"name": "captain", "system": system})
    assert created.status_code == 201, created.text
    text = tokenizer.apply_chat_template([{"role": "system", "content": system}], tokenize=False)
    num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    assert created.json()["num_tokens"] == num_tokens
    assert created.json()["pinned_blocks"] == num_tokens // BLOCK
    assert [p["name"] for p in httpx.get(server.url("/v1/presets")).json()["data"]] == ["captain"]
    assert post(server, "/v1/presets", {"name": "captain", "system": "x"}).status_code == 409

    session_id = new_session(server, preset="captain")
    reply = say(server, session_id, "What is RAM?")
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == num_tokens // BLOCK * BLOCK
    assert stored(server, session_id, 0)["system"] == system
    assert httpx.delete(server.url("/v1/presets/captain")).json()["deleted"] is True
    assert httpx.delete(server.url("/v1/presets/captain")).status_code == 404
    # sessions outlive presets
    assert say(server, session_id, "And ROM?")["choices"][0]["message"]["content"]


def test_chat_completions_with_a_session_header_keeps_history(server: RunningServer):
    import openai

    client = openai.OpenAI(base_url=server.openai_base_url, api_key="unused")
    session_id = "plainOpenAIclient00001"
    headers = {"X-Session-ID": session_id}
    first = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        temperature=0,
        max_tokens=16,
        messages=[{"role": "user", "content": "My name is Ada."}],
        extra_headers=headers,
    )
    stored(server, session_id, 2)
    second = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        temperature=0,
        max_tokens=16,
        messages=[{"role": "user", "content": "What is my name?"}],
        extra_headers=headers,
    )
    turn_one = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens > turn_one
    assert second.usage.prompt_tokens_details.cached_tokens == turn_one // BLOCK * BLOCK
    contents = [m["content"] for m in stored(server, session_id, 4)["messages"]]
    assert contents == [
        "My name is Ada.",
        first.choices[0].message.content,
        "What is my name?",
        second.choices[0].message.content,
    ]


def test_second_concurrent_message_gets_409_and_history_never_interleaves(server: RunningServer):
    session_id = new_session(server)
    started = threading.Event()
    long_reply = {
        "content": "Count from one to one hundred.",
        "max_tokens": 120,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }

    def first_turn() -> None:
        with httpx.stream(
            "POST", server.url(f"/v1/sessions/{session_id}/messages"), json=long_reply, timeout=120
        ) as response:
            for line in response.iter_lines():
                if '"content"' in line:
                    started.set()

    thread = threading.Thread(target=first_turn)
    thread.start()
    assert started.wait(60)
    busy = post(
        server, f"/v1/sessions/{session_id}/messages", {"content": "Interrupting!", **GREEDY}
    )
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "session_busy"
    thread.join(120)
    body = stored(server, session_id, 2)
    assert [m["content"] for m in body["messages"] if m["role"] == "user"] == [
        long_reply["content"]
    ]
    assert body["messages"][1]["usage"]["completion_tokens"] == 120
    say(server, session_id, "Thanks.")  # the lock is released once the turn is stored
    assert [m["role"] for m in stored(server, session_id, 4)["messages"]] == [
        "user",
        "assistant",
    ] * 2


def test_reply_cut_by_the_client_is_stored_as_interrupted(server: RunningServer):
    session_id = new_session(server)
    seen = ""
    with httpx.stream(
        "POST",
        server.url(f"/v1/sessions/{session_id}/messages"),
        timeout=120,
        json={
            "content": "Tell me a long story.",
            "max_tokens": 400,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        },
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                seen += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                if len(seen) > 20:
                    break  # the client walks away mid-reply
    reply = stored(server, session_id, 2)["messages"][1]
    assert reply["finish_reason"] == "abort"
    assert reply["content"].startswith(seen) and reply["usage"]["completion_tokens"] < 400
    wait_until_idle(server)
    # unlocked, and the cut reply is part of the history
    follow_up = say(server, session_id, "Go on.")
    assert (
        follow_up["usage"]["prompt_tokens"]
        > reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"]
    )


def test_regenerate_answers_the_last_message_again_from_the_same_prompt(server: RunningServer):
    session_id = new_session(server, system=SYSTEM)
    first = say(server, session_id, "Give me a fruit.")
    stored(server, session_id, 2)
    again = post(
        server, f"/v1/sessions/{session_id}/messages", {"regenerate": True, **GREEDY}
    ).json()
    # greedy
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert again["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]
    time.sleep(0.3)
    assert len(stored(server, session_id, 2)["messages"]) == 2


def test_session_listing_rename_and_delete(server: RunningServer):
    older, newer = new_session(server, title="older"), new_session(server, title="newer")
    listed = [s["id"] for s in httpx.get(server.url("/v1/sessions?limit=1000")).json()["data"]]
    assert listed.index(newer) < listed.index(older)
    paged, after = [], None
    while True:  # two at a time, each page after the last id of the one before
        page = httpx.get(
            server.url("/v1/sessions"), params={"limit": 2, **({"after": after} if after else {})}
        ).json()
        paged += [s["id"] for s in page["data"]]
        assert page["last_id"] == paged[-1] and len(page["data"]) <= 2
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert paged == listed
    bad_cursor = httpx.get(server.url("/v1/sessions"), params={"after": "AAAAAAAAAAAAAAAAAAAAAA"})
    assert bad_cursor.status_code == 400 and bad_cursor.json()["error"]["param"] == "after"
    renamed = httpx.patch(server.url(f"/v1/sessions/{older}"), json={"title": "renamed"})
    assert renamed.status_code == 200 and renamed.json()["title"] == "renamed"
    assert httpx.delete(server.url(f"/v1/sessions/{older}")).json() == {
        "id": older,
        "object": "session.deleted",
        "deleted": True,
    }
    assert httpx.get(server.url(f"/v1/sessions/{older}")).status_code == 404


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param"),
    [
        ("GET", "/v1/sessions/not-an-id", None, 404, "session_id"),
        ("GET", "/v1/sessions/AAAAAAAAAAAAAAAAAAAAAA", None, 404, "session_id"),
        ("DELETE", "/v1/sessions/AAAAAAAAAAAAAAAAAAAAAA", None, 404, "session_id"),
        (
            "POST",
            "/v1/sessions/AAAAAAAAAAAAAAAAAAAAAA/messages",
            {"content": "hi"},
            404,
            "session_id",
        ),
        ("POST", "/v1/sessions", {"system": 5}, 400, "system"),
        ("POST", "/v1/sessions", {"system": "a", "preset": "b"}, 400, "preset"),
        ("POST", "/v1/sessions", {"preset": "no-such-preset"}, 400, "preset"),
        ("GET", "/v1/sessions?limit=0", None, 400, "limit"),
        ("POST", "/v1/presets", {"name": "bad name!", "system": "x"}, 400, "name"),
        ("POST", "/v1/presets", {"name": "ok", "system": ""}, 400, "system"),
        ("DELETE", "/v1/presets/none", None, 404, "name"),
    ],
)
def test_bad_session_requests(server: RunningServer, method, path, body, status, param):
    response = httpx.request(method, server.url(path), json=body, timeout=30)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "content"),
        ({"content": "x", "regenerate": True}, "content"),
        ({"content": 7}, "content"),
        ({"regenerate": True}, "regenerate"),  # nothing to regenerate yet
        ({"content": "x", "temperature": -1}, "temperature"),
        ({"content": "x", "max_tokens": 10**6}, "max_tokens"),
    ],
)
def test_bad_message_bodies_get_400_and_leave_the_session_usable(
    server: RunningServer, body, param
):
    session_id = new_session(server)
    response = post(server, f"/v1/sessions/{session_id}/messages", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    # not left locked
    assert (
        say(server, session_id, "Hello", max_tokens=4, ignore_eos=True)["usage"][
            "completion_tokens"
        ]
        == 4
    )


def test_redis_outage_gives_503_on_session_routes_only(
    server: RunningServer, redis_server: RedisServer
):
    session_id = new_session(server)
    say(server, session_id, "Remember the word 'teal'.", max_tokens=4)
    stored(server, session_id, 2)
    redis_server.stop()
    try:
        for response in (
            httpx.get(server.url(f"/v1/sessions/{session_id}")),
            httpx.get(server.url("/v1/sessions")),
            post(server, "/v1/sessions", {}),
            post(server, f"/v1/sessions/{session_id}/messages", {"content": "hi"}),
        ):
            assert response.status_code == 503, response.text
            assert "Redis" in response.json()["error"]["message"]
        stateless = post(
            server,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], **GREEDY},
        )
        assert stateless.status_code == 200
        health = httpx.get(server.url("/health"))
        assert health.status_code == 200 and health.json()["sessions"] == "unavailable"
    finally:
        redis_server.start()
    body = stored(server, session_id, 2)
    assert body["messages"][0]["content"] == "Remember the word 'teal'."
    assert (
        say(server, session_id, "Which word?", max_tokens=4, ignore_eos=True)["usage"][
            "completion_tokens"
        ]
        == 4
    )
    log = server.log()  # four failed requests, one line; and one when it came back
    assert (
        log.count("session store: Redis is unreachable") == 1
        and log.count("Redis is reachable again") == 1
    )


def test_the_first_session_request_after_a_redis_restart_is_served(
    server: RunningServer, redis_server: RedisServer
):
    session_id = new_session(server)
    stored(server, session_id, 0)
    redis_server.stop()
    # the server's pooled connections are stale now: the first use of one fails
    redis_server.start()
    assert httpx.get(server.url(f"/v1/sessions/{session_id}")).status_code == 200
    assert (
        say(server, session_id, "Hi", max_tokens=2, ignore_eos=True)["usage"]["completion_tokens"]
        == 2
    )


def test_history_survives_a_server_restart_with_the_same_redis(redis_server: RedisServer):
    with running_server("--redis-url", redis_server.url) as first_server:
        session_id = new_session(first_server, system=SYSTEM)
        first = say(first_server, session_id, "What is the largest planet?")
        stored(first_server, session_id, 2)
    with running_server("--redis-url", redis_server.url) as second_server:
        body = stored(second_server, session_id, 2)
        assert [m["content"] for m in body["messages"]] == [
            "What is the largest planet?",
            first["choices"][0]["message"]["content"],
        ]
        second = say(second_server, session_id, "And the smallest?")
        # a cold cache after the restart
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        stateless = stateless_second_turn(
            second_server, "What is the largest planet?", first, "And the smallest?"
        )
        assert (
            stateless["choices"][0]["message"]["content"]
            == second["choices"][0]["message"]["content"]
        )


def test_unreachable_redis_at_start_is_a_clear_error_and_a_non_zero_exit():
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    result = subprocess.run(
        server_command(free_port(), ["--redis-url", url]),
        env=server_env(),
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    # the operator's to fix, before the model loads (tests/server/test_startup_errors.py)
    assert result.returncode == 2
    assert f"no Redis answers at {url}" in result.stdout + result.stderr


def test_api_keys_are_tenants_for_sessions_and_prefix_blocks():
    long_prompt = "Here is a long shared document about tides and the moon. " * 12
    with running_server("--api-key", "key-one,key-two", "--tenant-salt-from-api-key") as server:
        one, two = ({"Authorization": f"Bearer {k}"} for k in ("key-one", "key-two"))
        session = post(server, "/v1/sessions", {"title": "mine"}, headers=one).json()["id"]
        assert httpx.get(server.url(f"/v1/sessions/{session}"), headers=two).status_code == 404
        assert httpx.get(server.url("/v1/sessions"), headers=two).json()["data"] == []
        assert (
            httpx.get(
                server.url("/v1/sessions"), headers={"Authorization": "Bearer nope"}
            ).status_code
            == 401
        )

        def cached(headers: dict) -> int:
            body = {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 1}
            return post(server, "/v1/chat/completions", body, headers=headers).json()["usage"][
                "prompt_tokens_details"
            ]["cached_tokens"]

        assert cached(one) == 0
        assert cached(two) == 0  # the same text under another key: never a hit
        assert cached(one) > 0


def test_oversized_preset_is_rejected_and_startup_survives_bad_ones(redis_server: RedisServer):
    client = redis_server.client()
    # ~170 tokens > 128
    huge = "You are a pirate who explains computers with long, colourful stories. " * 12
    try:
        with running_server("--redis-url", redis_server.url, "--max-model-len", "128") as server:
            refused = post(server, "/v1/presets", {"name": "huge", "system": huge})
            assert refused.status_code == 400, refused.text
            assert (
                refused.json()["error"]["param"] == "system"
                and "128" in refused.json()["error"]["message"]
            )
            assert not client.exists("pagedchat:preset:huge") and "huge" not in client.smembers(
                "pagedchat:presets"
            )
            assert (
                post(server, "/v1/presets", {"name": "small", "system": "Be brief."}).status_code
                == 201
            )
        # a preset that cannot be prefilled, stored behind the server's back (an older version, or a start with a
        # larger --max-model-len): every replica sharing this Redis must still start
        client.hset(
            "pagedchat:preset:huge", mapping={"name": "huge", "system": huge, "created_at": "1"}
        )
        client.sadd("pagedchat:presets", "huge")
        with running_server("--redis-url", redis_server.url, "--max-model-len", "128") as server:
            # (stored presets pin in the background after start-up, by name)
            deadline = time.monotonic() + 30
            while "preset 'small': " not in server.log() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert "preset 'huge' skipped" in server.log() and "preset 'small': " in server.log()
            presets = {p["name"]: p for p in httpx.get(server.url("/v1/presets")).json()["data"]}
            assert set(presets) == {"huge", "small"}
            assert presets["small"]["num_tokens"] > 0 and presets["huge"]["num_tokens"] is None
            unusable = post(server, "/v1/sessions", {"preset": "huge"})
            assert unusable.status_code == 400 and unusable.json()["error"]["param"] == "preset"
            session_id = new_session(server, preset="small")
            assert (
                say(server, session_id, "Hi", max_tokens=4, ignore_eos=True)["usage"][
                    "completion_tokens"
                ]
                == 4
            )
            assert httpx.get(server.url("/health")).status_code == 200
    finally:
        for name in ("huge", "small"):
            client.delete(f"pagedchat:preset:{name}")
            client.srem("pagedchat:presets", name)


def test_turn_end_with_redis_down_ends_normally_and_keeps_the_turn(redis_server: RedisServer):
    with running_server(
        "--redis-url", redis_server.url, "--session-write-timeout-s", "1"
    ) as server:
        session_id = new_session(server)
        payloads, last_token = [], 0.0
        body = {
            "content": "Count slowly from one to one hundred.",
            "max_tokens": 40,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        try:
            with httpx.stream(
                "POST", server.url(f"/v1/sessions/{session_id}/messages"), json=body, timeout=120
            ) as response:
                for line in response.iter_lines():
                    if (
                        line.startswith("data: {")
                        and '"content":"' in line
                        and redis_server.process is not None
                    ):
                        redis_server.stop()  # Redis goes away while the reply streams
                    if '"content"' in line:
                        last_token = time.monotonic()
                    payloads.append(line)
            done = time.monotonic()
            chunks = sse_chunks(sse_data(payloads))
            assert chunks[-1]["session_turn"] == "pending" and not chunks[-1]["choices"], (
                "said in an extension field"
            )
            assert "data: [DONE]" in payloads, "the stream ends normally"
            finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
            assert finish[-1] == "length", "with the real finish_reason"
            assert done - last_token < 4, (
                "the answer ends within the write window, not when Redis returns"
            )
            text = "".join(
                c["choices"][0]["delta"].get("content", "") for c in chunks if c.get("choices")
            )
            assert "kept in memory" in server.log()
            # Redis still away
            shown = httpx.get(server.url(f"/v1/sessions/{session_id}"), timeout=30)
            assert shown.status_code == 200 and shown.json()["turn_pending"] is True, (
                "the session shows it pending"
            )
            assert shown.json()["messages"][-1]["content"] == text
        finally:
            if redis_server.process is None:
                redis_server.start()

        # Redis is back: the kept turn is written (before it is read)
        kept = stored(server, session_id, 2)
        assert [m["role"] for m in kept["messages"]] == ["user", "assistant"]
        assert (
            kept["messages"][1]["content"] == text
            and kept["messages"][1]["usage"]["completion_tokens"] == 40
        )
        follow_up = say(server, session_id, "Thanks.", max_tokens=4)  # the turn's lock was released
        assert (
            follow_up["usage"]["prompt_tokens"] > kept["messages"][1]["usage"]["prompt_tokens"] + 40
        )


def test_history_survives_a_server_restart_with_the_default_sqlite_store(tmp_path):
    path = str(tmp_path / "sessions.sqlite3")
    with running_server("--session-db-path", path) as first_server:
        assert httpx.get(first_server.url("/health")).json()["sessions"] == "sqlite"
        session_id = new_session(first_server, system=SYSTEM)
        first = say(first_server, session_id, "What is the largest planet?", max_tokens=6)
        stored(first_server, session_id, 2)
    with running_server("--session-db-path", path) as second_server:
        body = stored(second_server, session_id, 2)
        assert [m["content"] for m in body["messages"]] == [
            "What is the largest planet?",
            first["choices"][0]["message"]["content"],
        ]
        assert (
            say(second_server, session_id, "And the smallest?", max_tokens=4)["usage"][
                "completion_tokens"
            ]
            == 4
        )


def test_start_up_never_waits_on_stored_presets_and_a_key_has_a_preset_quota(tmp_path):
    import asyncio

    from app.sessions import Preset, SQLiteSessionStore

    path = tmp_path / "sessions.sqlite3"

    async def store_many() -> None:
        store = SQLiteSessionStore(path, 3600)
        # each is a prefill on the engine: tens of seconds in all on a small CPU
        for i in range(40):
            await store.save_preset(
                Preset(f"p{i}", f"You are helper number {i}. " + "Answer politely. " * 40)
            )
        await store.close()

    asyncio.run(store_many())
    with running_server(
        "--session-db-path", str(path), "--max-presets-per-key", "1", "--api-key", "k1"
    ) as server:
        # healthy (running_server waited for it) while the stored presets still pin in the background
        assert "pinning 40 stored presets in the background" in server.log()
        assert server.log().count("blocks pinned") < 40
        key = {"Authorization": "Bearer k1"}  # (the 40 stored ones are shared: not this key's)
        assert (
            post(
                server, "/v1/presets", {"name": "mine", "system": "Be brief."}, headers=key
            ).status_code
            == 201
        )
        refused = post(
            server, "/v1/presets", {"name": "one-too-many", "system": "Be terse."}, headers=key
        )
        assert (
            refused.status_code == 429
            and refused.json()["error"]["code"] == "preset_quota_exceeded"
        )
