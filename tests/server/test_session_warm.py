"""POST /v1/sessions/{id}/warm (issue 52): a session's stored prefix is brought back from the lower KV tiers before
its next turn. Only the caller's own session (404 otherwise, as for GET), nothing to warm in an empty session, one
warm of a session at a time, under the salt the session's turns use; session turns reach the engine as retained
(stateless requests do not); /metrics shows the tiers; the chat UI warms a chat when its message box gets focus,
at most once per 30 s, and never warms a draft.

One server (two API keys, the disk tier on in a directory of its own) serves the module; the warm's own rules are
also checked on a stand-in engine, without a server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from app.admission import Admission
from app.sessions.store import Session, new_session_id
from app.sessions.warm_api import warm_prefix
from engine.sampling_params import SamplingParams
from tests.server_harness import RunningServer, running_server
from tests.web_harness import SHORT, browser_fixture, preset_settings

KEY_A, KEY_B = "warm-key-a", "warm-key-b"
BLOCK = 16
TURN = {"temperature": 0, "max_tokens": 8}
POOL_BLOCKS = 40  # the device's KV pool: small, so one long prompt evicts a session's blocks


# the warm's rules on a stand-in engine ---------------------------------------------------------------------


class WarmingEngine:
    """Records warm_prefix calls; each waits until ``release`` is set, then answers ``blocks``."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self.calls: list[tuple[list[int], str | None]] = []
        self.release = asyncio.Event()

    async def warm_prefix(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        self.calls.append((list(token_ids), cache_salt))
        await self.release.wait()
        return self.blocks


def stand_in_service(engine: WarmingEngine) -> Any:
    return SimpleNamespace(engine=engine, warming=set())


async def test_an_empty_session_warms_nothing_and_asks_the_engine_nothing():
    engine = WarmingEngine(blocks=5)
    engine.release.set()
    assert await warm_prefix(stand_in_service(engine), Session(id=new_session_id()), "s") == 0
    assert engine.calls == []


async def test_a_second_warm_of_a_session_while_one_runs_answers_zero_at_once():
    engine = WarmingEngine(blocks=3)
    service = stand_in_service(engine)
    session = Session(id=new_session_id(), token_ids=list(range(40)))
    first = asyncio.create_task(warm_prefix(service, session, "tenant/salt"))
    while not engine.calls:
        await asyncio.sleep(0)
    assert await warm_prefix(service, session, "tenant/salt") == 0  # (the first still waits)
    other = Session(id=new_session_id(), token_ids=[7] * 20)
    other_warm = asyncio.create_task(
        warm_prefix(service, other, None)
    )  # another session is not held up
    while len(engine.calls) < 2:
        await asyncio.sleep(0)
    engine.release.set()
    assert (await first, await other_warm) == (3, 3)
    assert engine.calls == [(list(range(40)), "tenant/salt"), ([7] * 20, None)]
    assert service.warming == set()
    assert await warm_prefix(service, session, "tenant/salt") == 3  # done: the next one runs


class RecordingEngine:
    healthy = True
    num_queued = 0

    def __init__(self) -> None:
        self.retain: list[bool] = []

    def num_queued_for(self, tenant: str) -> int:
        return 0

    def generate(self, prompt_ids: list[int], params: SamplingParams, **kwargs: Any) -> Any:
        self.retain.append(kwargs.get("retain", False))
        return SimpleNamespace(request_id="r")


async def test_admission_hands_retain_to_the_engine_and_stateless_requests_are_not_retained():
    engine = RecordingEngine()
    admission = Admission(engine, None, ("m",), max_queue=8, max_queue_per_tenant=8)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=1)
    await admission.submit([1, 2, 3], params, None, 0.0, retain=True)
    await admission.submit([1, 2, 3], params, None, 0.0)
    assert engine.retain == [True, False]


# over HTTP -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    kv_dir = tmp_path_factory.mktemp("kv")
    with running_server(
        "--api-key",
        f"{KEY_A},{KEY_B}",
        "--kv-disk-path",
        str(kv_dir),
        "--kv-disk-size",
        "64MiB",
        "--num-kv-blocks",
        str(POOL_BLOCKS),
    ) as server:
        yield server


def call(server: RunningServer, method: str, path: str, key: str, **kwargs: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.request(method, server.url(path), headers=headers, timeout=120, **kwargs)


def new_session(server: RunningServer, key: str) -> str:
    response = call(server, "POST", "/v1/sessions", key, json={})
    assert response.status_code == 201, response.text
    return response.json()["id"]


@pytest.fixture(scope="module")
def session_with_a_turn(server: RunningServer) -> dict:
    """KEY_A's session after one turn, as GET returns it."""
    session_id = new_session(server, KEY_A)
    content = "Name three colours of the rainbow, and say which one comes first in it."
    turn = call(
        server,
        "POST",
        f"/v1/sessions/{session_id}/messages",
        KEY_A,
        json={"content": content, **TURN},
    )
    assert turn.status_code == 200, turn.text
    return call(server, "GET", f"/v1/sessions/{session_id}", KEY_A).json()


@pytest.mark.slow
def test_warm_after_a_turn_answers_how_many_blocks_are_on_their_way(
    server: RunningServer, session_with_a_turn: dict
):
    session_id = session_with_a_turn["id"]
    response = call(server, "POST", f"/v1/sessions/{session_id}/warm", KEY_A)
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["id"], body["object"]) == (session_id, "session.warm")
    # at most the full blocks of the stored prefix (prompt + reply of the turn)
    full_blocks = session_with_a_turn["stats"]["num_tokens"] // BLOCK
    assert full_blocks >= 1
    assert type(body["blocks"]) is int and 0 <= body["blocks"] <= full_blocks


@pytest.mark.slow
def test_a_session_evicted_from_the_device_is_warmed_from_disk_and_its_next_turn_hits_it(
    server: RunningServer,
):
    session_id = new_session(server, KEY_B)
    content = "Say hello to the moon, the sun and the stars, one line for each of them."
    turns = f"/v1/sessions/{session_id}/messages"
    first = call(server, "POST", turns, KEY_B, json={"content": content, **TURN})
    assert first.status_code == 200, first.text
    # a one-off prompt taking all but two blocks of the pool: the session's kept blocks go (tail first), its turn's
    # copies on disk stay
    filler = {
        "prompt": [1000 + i % 3000 for i in range((POOL_BLOCKS - 2) * BLOCK - 2)],
        "max_tokens": 2,
    }
    assert call(server, "POST", "/v1/completions", KEY_B, json=filler).status_code == 200
    # the turn's blocks are written off the step loop: warm until they are on disk (a bounded wait, not a guess)
    deadline, blocks = time.monotonic() + 30, 0
    while blocks == 0 and time.monotonic() < deadline:
        warm = call(server, "POST", f"/v1/sessions/{session_id}/warm", KEY_B)
        assert warm.status_code == 200, warm.text
        blocks = warm.json()["blocks"]
    stored = call(server, "GET", f"/v1/sessions/{session_id}", KEY_B).json()
    assert 1 <= blocks <= stored["stats"]["num_tokens"] // BLOCK
    second = call(server, "POST", turns, KEY_B, json={"content": "And the clouds?", **TURN})
    assert second.status_code == 200, second.text
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    # the warmed blocks were hit, as were the head blocks the device kept
    assert cached >= blocks * BLOCK


@pytest.mark.slow
def test_warm_of_another_keys_session_is_404_as_for_get(
    server: RunningServer, session_with_a_turn: dict
):
    path = f"/v1/sessions/{session_with_a_turn['id']}"
    for response in (call(server, "POST", f"{path}/warm", KEY_B), call(server, "GET", path, KEY_B)):
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "session_not_found"


@pytest.mark.slow
def test_warm_of_a_missing_or_malformed_session_is_404(server: RunningServer):
    for session_id in (new_session_id(), "not-a-session-id"):
        response = call(server, "POST", f"/v1/sessions/{session_id}/warm", KEY_A)
        assert response.status_code == 404, response.text
        assert response.json()["error"]["param"] == "session_id"


@pytest.mark.slow
def test_warm_of_an_empty_session_warms_no_blocks(server: RunningServer):
    session_id = new_session(server, KEY_B)
    response = call(server, "POST", f"/v1/sessions/{session_id}/warm", KEY_B)
    assert response.status_code == 200, response.text
    assert response.json() == {"id": session_id, "object": "session.warm", "blocks": 0}


@pytest.mark.slow
def test_metrics_show_the_disk_and_redis_tiers(server: RunningServer):
    text = httpx.get(server.url("/metrics"), timeout=10).text
    for name in (
        "pagedchat:prefix_cache_disk_hits_total",
        "pagedchat:prefix_cache_redis_hits_total",
        "pagedchat:kv_disk_blocks",
        "pagedchat:kv_tier_read_bytes_total",
        "pagedchat:kv_tier_written_bytes_total",
        "pagedchat:kv_tier_restore_seconds_total",
        "pagedchat:kv_tier_rejected_blocks_total",
    ):
        assert f"\n{name}{{" in text, name


# the chat UI ------------------------------------------------------------------------------------------------

browser = browser_fixture()

# every fetch the page makes, recorded as it is made (fetch is called synchronously in the focus handler, so
# the list is complete as soon as the focus is)
RECORD_FETCHES = """
window.__fetches = [];
const pageFetch = window.fetch;
window.fetch = (url, options) => {
  window.__fetches.push(`${(options && options.method) || "GET"} ${url}`);
  return pageFetch(url, options);
};
"""


def warms(page: Any) -> list[str]:
    return page.evaluate("() => window.__fetches.filter((f) => f.endsWith('/warm'))")


@pytest.mark.slow
def test_focusing_the_message_box_of_a_chat_warms_its_session_once_per_30_s(
    browser: Any, server: RunningServer, session_with_a_turn: dict
):
    context = browser.new_context()
    preset_settings(context, **{**SHORT, "apiKey": KEY_A})
    context.add_init_script(RECORD_FETCHES)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    session_id = session_with_a_turn["id"]
    page.goto(server.url(f"/?s={session_id}"))
    # the chat opens with its message box focused
    page.wait_for_function("() => window.__fetches.some((f) => f.endsWith('/warm'))")
    assert warms(page) == [f"POST /v1/sessions/{session_id}/warm"]
    page.evaluate(
        "() => { const i = document.querySelector('#composer-input'); i.blur(); i.focus(); }"
    )
    assert len(warms(page)) == 1  # within 30 s of the last
    page.click("#new-chat")
    page.wait_for_function(
        "() => document.querySelector('#composer-input') === document.activeElement"
    )
    assert len(warms(page)) == 1  # a draft has no session to warm
    assert page.locator("#error").is_hidden() and not errors
    context.close()
