"""POST /v1/sessions/{id}/fork: a fork holds the parent's first N turns and their exact token ids, so its next turn
extends them and hits the parent's KV blocks; the parent is unchanged; another key's session is not found; ``turn``
is checked (an integer in [0, the number of turns]); a session stored without per-message token ends (an older
server) is forked with no ids where a turn's end is not known, and its next turn renders the whole conversation
(never a wrong prefix).

On the same app (one engine for the module): a session's system prompt changed (PATCH): the stored ids go with the
old prompt, so the next turn, a regeneration and a fork render the whole conversation with the new one; the
change is refused (409) while a turn holds the session. And the model served under two names: each is listed and
answers, and an answer carries the name its request gave.

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


NAMES = ["smol-main", "org/smol-alias"]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with session_app(served_model_name=NAMES) as client:
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


def own_ids(client: TestClient, session_id: str) -> list[int]:
    """(the memory store's own copy)"""
    return client.app.state.server.sessions.store._sessions[session_id][0].token_ids


def chat_ids(client: TestClient, messages: list[dict]) -> list[int]:
    """The prompt of ``messages`` as the model's own chat template renders it (no session code involved)."""
    tokenizer = client.app.state.server.engine.tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


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


def test_session_without_token_ends_forks_at_any_turn_and_renders_it_whole(
    client: TestClient, parent: dict
):
    """A session as an older server stored it: messages without their token ends. A fork where the end of its
    turns is not known keeps no ids; its next turn renders the whole conversation (never a wrong prefix)."""
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
    branch = fork(client, old.id, {"turn": 1})
    assert branch.status_code == 201, branch.text
    assert own_ids(client, branch.json()["id"]) == []
    reply = say(client, branch.json()["id"], "Name a planet.", 2)
    kept = [{"role": m["role"], "content": m["content"]} for m in parent["messages"][:2]]
    system = [{"role": "system", "content": parent["system"]}]
    expected = chat_ids(client, [*system, *kept, {"role": "user", "content": "Name a planet."}])
    assert reply["usage"]["prompt_tokens"] == len(expected)
    assert own_ids(client, branch.json()["id"])[: len(expected)] == expected
    whole = fork(client, old.id, {"turn": len(QUESTIONS)})
    assert whole.status_code == 201 and own_ids(client, whole.json()["id"]) == full.token_ids
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


# a new system prompt ------------------------------------------------------------------------------------------


def set_system(client: TestClient, session_id: str, system, key: str = "alice"):
    return client.patch(f"/v1/sessions/{session_id}", json={"system": system}, headers=auth(key))


def test_a_new_system_prompt_is_rendered_whole_into_the_next_turn(client: TestClient):
    created = client.post("/v1/sessions", json={"system": "Answer in one word."}, headers=auth())
    session_id = created.json()["id"]
    say(client, session_id, QUESTIONS[0], 0)
    new_system = "You are a pirate. Answer in rhymes."
    changed = set_system(client, session_id, new_system)
    assert changed.status_code == 200, changed.text
    assert (changed.json()["system"], changed.json()["preset"]) == (new_system, None)
    assert own_ids(client, session_id) == []  # (rendered with the old prompt)
    shown = client.get(f"/v1/sessions/{session_id}", headers=auth()).json()
    assert shown["system"] == new_system and len(shown["messages"]) == 2

    reply = say(client, session_id, QUESTIONS[1], 2)
    history = [{"role": m["role"], "content": m["content"]} for m in shown["messages"]]
    expected = chat_ids(
        client,
        [
            {"role": "system", "content": new_system},
            *history,
            {"role": "user", "content": QUESTIONS[1]},
        ],
    )
    assert reply["usage"]["prompt_tokens"] == len(expected)
    assert own_ids(client, session_id)[: len(expected)] == expected

    cleared = set_system(client, session_id, None)
    assert cleared.status_code == 200 and cleared.json()["system"] is None
    after = client.get(f"/v1/sessions/{session_id}", headers=auth()).json()
    assert after["system"] is None
    history = [{"role": m["role"], "content": m["content"]} for m in after["messages"]]
    # regenerating the last reply renders its prompt again, now without a system prompt
    again = client.post(
        f"/v1/sessions/{session_id}/messages",
        json={"regenerate": True, "max_tokens": 4, "temperature": 0},
        headers=auth(),
    )
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens"] == len(chat_ids(client, history[:-1]))


def test_a_session_with_a_new_system_prompt_still_forks_at_any_turn(
    client: TestClient, parent: dict
):
    """Before and after the turn that renders the new prompt: the earlier turns' ends are not known in either."""
    copy = fork(client, parent["id"], {"turn": 2}).json()
    assert set_system(client, copy["id"], "Answer in two words.").status_code == 200
    assert fork(client, copy["id"], {"turn": 1}).status_code == 201
    say(client, copy["id"], QUESTIONS[2], 4)
    branch = fork(client, copy["id"], {"turn": 1})
    assert branch.status_code == 201, branch.text
    reply = say(client, branch.json()["id"], "Name a planet.", 2)
    kept = [{"role": m["role"], "content": m["content"]} for m in parent["messages"][:2]]
    system = [{"role": "system", "content": "Answer in two words."}]
    expected = chat_ids(client, [*system, *kept, {"role": "user", "content": "Name a planet."}])
    assert reply["usage"]["prompt_tokens"] == len(expected)


def test_a_system_prompt_change_waits_for_no_turn_it_is_refused_while_one_holds_the_session(
    client: TestClient, parent: dict
):
    store = client.app.state.server.sessions.store
    copy = fork(client, parent["id"], {"turn": 1}).json()
    token = client.portal.call(store.lock, copy["id"], 30.0)  # (what a turn being answered holds)
    busy = set_system(client, copy["id"], "Answer in French.")
    assert busy.status_code == 409, busy.text
    assert busy.json()["error"]["code"] == "session_busy"
    shown = client.get(f"/v1/sessions/{copy['id']}", headers=auth()).json()
    assert shown["system"] == parent["system"] and own_ids(client, copy["id"])
    client.portal.call(store.unlock, copy["id"], token)
    assert set_system(client, copy["id"], "Answer in French.").status_code == 200


@pytest.mark.parametrize("system", ["x" * 32_769, 5, ["a"], {"text": "a"}])
def test_a_bad_system_prompt_is_refused_naming_system(client: TestClient, parent: dict, system):
    response = set_system(client, parent["id"], system)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "system"


def test_another_keys_session_system_prompt_is_not_found(client: TestClient, parent: dict):
    response = set_system(client, parent["id"], "mine now", key="bob")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "session_not_found"
    assert client.get(f"/v1/sessions/{parent['id']}", headers=auth()).json() == parent


# several served names -----------------------------------------------------------------------------------------


def test_each_served_name_is_listed_and_answers_under_its_own_name(client: TestClient):
    listed = client.get("/v1/models", headers=auth()).json()["data"]
    assert [card["id"] for card in listed] == NAMES
    assert listed[0]["max_model_len"] == listed[1]["max_model_len"] == 1024
    alias = client.get(f"/v1/models/{NAMES[1]}", headers=auth())
    assert alias.status_code == 200 and alias.json()["id"] == NAMES[1]
    unknown = client.get("/v1/models/smol", headers=auth())
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    for model, shown in ((NAMES[1], NAMES[1]), (NAMES[0], NAMES[0]), (None, NAMES[0])):
        body = {**chat, "model": model} if model else chat
        answer = client.post("/v1/chat/completions", json=body, headers=auth())
        assert answer.status_code == 200 and answer.json()["model"] == shown, answer.text
    text = client.post(
        "/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "model": NAMES[1]}, headers=auth()
    )
    assert text.json()["model"] == NAMES[1], text.text
    refused = client.post("/v1/chat/completions", json={**chat, "model": "smol"}, headers=auth())
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "model"


def test_a_session_turn_answers_under_the_name_it_asked_for(client: TestClient):
    session_id = client.post("/v1/sessions", json={}, headers=auth()).json()["id"]
    turn = {"content": "Hi", "max_tokens": 1, "model": NAMES[1]}
    response = client.post(f"/v1/sessions/{session_id}/messages", json=turn, headers=auth())
    assert response.status_code == 200 and response.json()["model"] == NAMES[1], response.text
    stored(client, session_id, 2)
    streamed = client.post(
        f"/v1/sessions/{session_id}/messages",
        json={**turn, "model": "unknown-model", "stream": True},
        headers=auth(),
    )
    assert streamed.status_code == 404 and streamed.json()["error"]["param"] == "model"
