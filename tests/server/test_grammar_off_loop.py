"""A response_format schema is compiled in a grammar worker process, started with the server (warm within seconds
of /health being 200: a request meanwhile waits for it), and within a limit of CPU time (a schema no model can
follow is a 400 up front); the engine core gets the compiled grammar (it compiles nothing on its step loop) and
builds one matcher per request, copied for its other samples."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.sampling_params import SamplingParams, StructuredOutput
from tests.server_harness import RunningServer, server_fixture

server = server_fixture("--grammar-workers", "2")  # (the test counts both)


def enum_schema(count: int) -> str:
    """An object whose one field is a string from a long enum (hundreds of kB: seconds to compile)."""
    return json.dumps(
        {
            "type": "object",
            "properties": {"x": {"enum": [f"value-{i}-abcabc" for i in range(count)]}},
            "required": ["x"],
            "additionalProperties": False,
        }
    )


def grammar_workers_of(pid: int) -> set[int]:
    """The processes under ``pid`` named as grammar workers (from /proc: each process's name and parent)."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # (ended meanwhile)
            continue
        name, _, rest = stat.partition("(")[2].rpartition(")")
        names[int(entry)], parents[int(entry)] = name, int(rest.split()[1])

    def under(child: int) -> bool:
        while child in parents and parents[child] > 1:
            child = parents[child]
            if child == pid:
                return True
        return False

    return {p for p, name in names.items() if name == "pagedchat-gramm" and under(p)}


def test_the_grammar_workers_start_with_the_server_and_the_first_request_starts_none(
    server: RunningServer,
):
    # (spawned with the server: named as soon as their Python has started, which may be just after /health)
    deadline = time.monotonic() + 60
    while (
        len(workers := grammar_workers_of(server.process.pid)) < 2 and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert len(workers) == 2, "both workers were started with the server"
    body = {
        "messages": [{"role": "user", "content": "Reply with a JSON object."}],
        "max_tokens": 8,
        "temperature": 0,
        "response_format": {"type": "json_object"},
    }
    reply = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=120)
    assert reply.status_code == 200, reply.text[:300]
    assert reply.json()["choices"][0]["message"]["content"].startswith("{")
    assert grammar_workers_of(server.process.pid) == workers, "no worker was started for it"


def test_the_event_loop_answers_while_a_large_schema_compiles(server: RunningServer):
    body = {
        "messages": [{"role": "user", "content": "Pick one."}],
        "max_tokens": 24,
        "temperature": 0,
        "n": 4,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "pick", "schema": json.loads(enum_schema(20000))},
        },
    }
    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.setdefault(
            "response", httpx.post(server.url("/v1/chat/completions"), json=body, timeout=120)
        )
    )
    worker.start()
    slowest = 0.0
    while worker.is_alive():
        start = time.monotonic()
        assert httpx.get(server.url("/health"), timeout=10).status_code == 200
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.02)
    worker.join()
    response = result["response"]
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 4
    # (the enum is long: a reply may be cut before it closes; what is there is in it)
    for choice in choices:
        text = choice["message"]["content"]
        assert text.startswith(('{"x":"value-', '{"x": "value-')), text
    assert slowest < 1.0, f"/health took {slowest:.2f} s while the schema compiled"


@pytest.mark.asyncio(loop_scope="module")
async def test_a_compiled_spec_carries_its_grammar_and_is_not_compiled_again(shared_engine):
    spec = StructuredOutput("json_schema", schema=enum_schema(50))
    compiled = await shared_engine.compile_structured_output(spec)
    assert compiled.grammar and compiled.schema == spec.schema
    params = SamplingParams(temperature=0.0, max_tokens=12, n=3, structured_output=compiled)
    outputs = [out async for out in shared_engine.generate([1, 2, 3, 4], params)]
    finals = [out for out in outputs if out.finished]
    assert len(finals) == 3 and all(
        out.text.replace(" ", "").startswith('{"x":"value-') for out in finals
    )


@pytest.mark.parametrize(
    "schema, reason",
    [
        (
            {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
            "no finite JSON value",
        ),
        (
            {
                "type": "object",
                "properties": {"s": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
                "required": ["s"],
            },
            "(per token|cannot be followed)",
        ),
    ],
    ids=["requires-itself", "exploding-pattern"],
)
def test_a_schema_that_cannot_be_followed_is_a_400_up_front(server: RunningServer, schema, reason):
    body = {
        "messages": [{"role": "user", "content": "Answer."}],
        "max_tokens": 8,
        "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    reply = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=120)
    assert reply.status_code == 400, reply.text[:300]
    error = reply.json()["error"]
    assert error["param"] == "response_format"
    assert re.search(reason, error["message"]), error["message"]


def named_under(pid: int, name: str) -> set[int]:
    return {p for p in _descendants(pid) if _name(p) == name}


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                children = {int(c) for c in task.read_text().split()}
                todo += children - found
                found |= children
    return found


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_the_cores_matchers_live_in_the_zygotes_matcher_server(server: RunningServer):
    """The engine core keeps no grammar state of its own: its matchers are the matcher server's, forked from the
    zygote that built llguidance's tokenizer once, so the core never loads llguidance (nor builds that tokenizer)."""
    body = {
        "messages": [{"role": "user", "content": "Reply with a JSON object."}],
        "max_tokens": 12,
        "temperature": 0,
        "n": 2,
        "response_format": {"type": "json_object"},
    }
    reply = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=120)
    assert reply.status_code == 200, reply.text[:300]
    assert all(c["message"]["content"].startswith("{") for c in reply.json()["choices"])
    (core,) = named_under(server.process.pid, "pagedchat-core")
    (zygote,) = named_under(server.process.pid, "pagedchat-gfork")
    assert named_under(zygote, "pagedchat-gmask"), "the zygote forked the matcher server"
    time.sleep(6)  # (a core that kept its own matchers warmed its tokenizer once idle 5 s)
    maps = Path(f"/proc/{core}/maps").read_text()
    assert "llguidance" not in maps, "the core loaded the grammar library"


def test_a_matcher_server_killed_mid_stream_ends_that_stream_only_and_the_next_grammar_runs(
    server: RunningServer,
):
    """The matcher server holds every constrained stream's grammar: killed, the streams it served end with an
    error event naming response_format (then [DONE]); an unconstrained stream beside them runs to its end; the
    zygote forks a new server and the next response_format request is answered."""
    from tests.engine.test_engine_process import data_events, stream_body

    numbers = {"type": "array", "items": {"type": "integer"}, "minItems": 200}
    constrained = {
        "messages": [{"role": "user", "content": "List numbers."}],
        "max_tokens": 600,
        "temperature": 0,
        "stream": True,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "numbers", "schema": numbers},
        },
    }
    (zygote,) = named_under(server.process.pid, "pagedchat-gfork")
    with contextlib.ExitStack() as stack:
        streams = []
        for body in (constrained, stream_body(200)):
            client = stack.enter_context(httpx.Client(timeout=120))
            response = stack.enter_context(
                client.stream("POST", server.url("/v1/chat/completions"), json=body)
            )
            assert response.status_code == 200
            events = data_events(response)
            first = [next(events) for _ in range(3)]
            streams.append((first, events))
        (matcher_server,) = named_under(zygote, "pagedchat-gmask")
        os.kill(matcher_server, signal.SIGKILL)
        (grammar_first, grammar_rest), (plain_first, plain_rest) = streams
        grammar_events = [*grammar_first, *grammar_rest]
        plain_events = [*plain_first, *plain_rest]
    assert grammar_events[-1] == "[DONE]" and plain_events[-1] == "[DONE]"
    error = json.loads(grammar_events[-2])
    assert "response_format" in error["error"]["message"], error
    assert json.loads(plain_events[-2])["choices"][0]["finish_reason"] == "length"
    assert not any('"error"' in e for e in plain_events)
    deadline = time.monotonic() + 10
    while not named_under(zygote, "pagedchat-gmask") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert named_under(zygote, "pagedchat-gmask") - {matcher_server}, "a new matcher server"
    body = {**constrained, "stream": False, "max_tokens": 12}
    body["response_format"] = {"type": "json_object"}
    reply = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=120)
    assert reply.status_code == 200, reply.text[:300]
    assert reply.json()["choices"][0]["message"]["content"].startswith("{")
