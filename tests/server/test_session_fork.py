"""POST /v1/sessions/{id}/fork: a fork holds the parent's first N turns and their exact token ids, so its next turn
extends them and hits the parent's KV blocks; the parent is unchanged; another key's session is not found; ``turn``
is checked (an integer in [0, the number of turns]); a session stored without per-message token ends (an older
server) is forked only whole (409 otherwise, never a wrong prefix).

The app runs in this process with the in-memory store. Expected cached tokens are counted by hand: the engine
caches full blocks of 16 tokens, so a prompt extending a stored prefix of P tokens hits at least floor(P / 16) * 16
of them."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from app.sessions import Session
from app.sessions.token_marks import common_prefix_len
from tests.server.session_app import auth, session_app

pytestmark = pytest.mark.slow

BLOCK = 16
QUESTIONS = ("Name a colour.", "Name a fruit.", "Name an animal.")


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with session_app() as client:
        yield client


def stored(client: TestClient, session_id: str, num_messages: int) -> dict:
    """The session once its last turn is stored (turns are written when their reply ends)."""
    deadline = time.monotonic() + 30
    while True:
        body = client.get(f"/v1/sessions/{session_id}", headers=auth()).json()
        if len(body.get("messages", [])) >= num_messages or time.monotonic() > deadline:
            return body
        time.sleep(0.05)


def say(client: TestClient, session_id: str, content: str, num_before: int) -> dict:
    response = client.post(
        f"/v1/sessions/{session_id}/messages",
        json={"content": content, "max_tokens": 8, "temperature": 0},
        headers=auth(),
    )
    assert response.status_code == 200, response.text
    stored(client, session_id, num_before + 2)
    return response.json()


@pytest.fixture(scope="module")
def parent(client: TestClient) -> dict:
    created = client.post("/v1/sessions", json={"system": "Answer in one word."}, headers=auth())
    assert created.status_code == 201, created.text
    session_id = created.json()["id"]
    for turn, question in enumerate(QUESTIONS):
        say(client, session_id, question, 2 * turn)
    return stored(client, session_id, 6)


def fork(client: TestClient, session_id: str, body: dict, key: str = "alice"):
    return client.post(f"/v1/sessions/{session_id}/fork", json=body, headers=auth(key))


def roles_and_contents(messages: list[dict]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in messages]


@pytest.mark.parametrize("turn", [0, 1])
def test_fork_keeps_first_turns_and_its_next_turn_hits_the_shared_prefix(
    client: TestClient, parent: dict, turn: int
):
    response = fork(client, parent["id"], {"turn": turn})
    assert response.status_code == 201, response.text
    forked = response.json()
    assert forked["id"] != parent["id"]
    assert (forked["parent_id"], forked["forked_at_turn"]) == (parent["id"], turn)
    assert forked["system"] == parent["system"] and forked["title"] == parent["title"]
    kept = parent["messages"][: 2 * turn]
    assert roles_and_contents(forked["messages"]) == roles_and_contents(kept)
    assert all("token_end" not in m for m in forked["messages"])

    reply = say(client, forked["id"], "Name a planet.", 2 * turn)
    after = stored(client, forked["id"], 2 * turn + 2)
    new_turn = [("user", "Name a planet."), ("assistant", after["messages"][-1]["content"])]
    assert roles_and_contents(after["messages"]) == roles_and_contents(kept) + new_turn
    if turn:
        # the shared prefix: the parent's ids through turn `turn`'s reply
        last = parent["messages"][2 * turn - 1]["usage"]
        shared = last["prompt_tokens"] + last["completion_tokens"]
        assert reply["usage"]["prompt_tokens"] > shared
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= shared // BLOCK * BLOCK > 0

    listed = client.get("/v1/sessions", headers=auth()).json()["data"]
    entry = next(s for s in listed if s["id"] == forked["id"])
    assert (entry["parent_id"], entry["forked_at_turn"]) == (parent["id"], turn)
    assert client.get(f"/v1/sessions/{parent['id']}", headers=auth()).json() == parent


def test_fork_of_whole_session_copies_it(client: TestClient, parent: dict):
    response = fork(client, parent["id"], {"turn": len(QUESTIONS)})
    assert response.status_code == 201, response.text
    assert roles_and_contents(response.json()["messages"]) == roles_and_contents(parent["messages"])
    assert parent["parent_id"] is None and parent["forked_at_turn"] is None


def test_another_keys_session_is_not_found(client: TestClient, parent: dict):
    response = fork(client, parent["id"], {"turn": 1}, key="bob")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "session_not_found"
    missing = fork(client, "NoSuchSession000000000", {"turn": 0})
    assert missing.status_code == 404


@pytest.mark.parametrize("body", [{"turn": -1}, {"turn": 4}, {"turn": "x"}, {"turn": True}, {}])
def test_bad_turn_is_refused_naming_turn(client: TestClient, parent: dict, body: dict):
    response = fork(client, parent["id"], body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "turn"


def test_session_without_token_ends_forks_only_whole(client: TestClient, parent: dict):
    """A session as an older server stored it: messages without their token ends."""
    store = client.app.state.server.sessions.store
    full = store._sessions[parent["id"]][0]  # (the memory store's own copy)
    old = Session(
        id="OlderServerSession0001",
        owner=full.owner,
        system=full.system,
        messages=[{k: v for k, v in m.items() if k != "token_end"} for m in full.messages],
        token_ids=full.token_ids,
    )
    assert client.portal.call(store.create, old)
    refused = fork(client, old.id, {"turn": 1})
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["param"] == "turn"
    assert fork(client, old.id, {"turn": len(QUESTIONS)}).status_code == 201
    assert fork(client, old.id, {"turn": 0}).status_code == 201  # nothing kept: no ids needed


def test_common_prefix_len_matches_a_plain_count():
    for a, b in [([], [1]), ([1, 2, 3], [1, 2, 4]), ([5] * 40, [5] * 40), ([1, 2], [1, 2, 3])]:
        plain = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(a, b) == plain


def test_a_body_that_is_not_json_is_refused_and_the_server_keeps_serving(
    client: TestClient, parent: dict
):
    headers = {**auth(), "content-type": "application/json"}
    response = client.post(
        f"/v1/sessions/{parent['id']}/fork", content=b"{turn: 1", headers=headers
    )
    assert response.status_code == 400, response.text
    response = client.post("/v1/sessions/import", content=b"\xff\xfe not json", headers=headers)
    assert response.status_code == 400, response.text
    assert fork(client, parent["id"], {"turn": 1}).status_code == 201


def test_an_import_of_a_huge_message_list_is_refused_naming_messages(client: TestClient):
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 2100
    response = client.post("/v1/sessions/import", json={"messages": messages}, headers=auth())
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages"
