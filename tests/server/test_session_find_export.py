"""Finding and keeping sessions: every store keeps a session's source, pin and fork parent (and a pin survives a
turn written meanwhile; an older SQLite file gains the new columns); the listing filters by source and puts pinned
sessions first; a search finds a word of a title or any message of the caller's own sessions (case-insensitive,
with a snippet), never another key's; export gives JSON with token counts or a Markdown download, and import gives
the same messages back as a new session whose next turn extends its token ids exactly.

The app runs in this process with the in-memory store; imported sessions give the search its texts without
generating them."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from app.sessions import Session, SQLiteSessionStore, new_session_id
from app.sessions.find import all_summaries, search
from tests.server.session_app import auth, session_app
from tests.server.test_session_store import store  # noqa: F401 (the fixture: each store)

TTL_S = 3600


# the stores --------------------------------------------------------------------------------------------


async def test_store_keeps_source_pin_and_parent(store):  # noqa: F811
    parent = Session(id=new_session_id(), owner="a", source="ui")
    fork = Session(id=new_session_id(), owner="a", parent_id=parent.id, forked_at_turn=2)
    assert await store.create(parent) and await store.create(fork)
    assert await store.set_pinned(parent.id, "a", True)
    assert not await store.set_pinned(parent.id, "b", True)  # another owner's: untouched

    turn = await store.get(parent.id, "a")
    assert turn is not None and turn.pinned and turn.source == "ui"
    turn.pinned = False  # a turn's stale copy...
    turn.messages = [{"role": "user", "content": "hi"}]
    assert await store.save_turn(turn)
    kept = await store.get(parent.id, "a")
    assert kept is not None and kept.pinned  # ...does not undo a pin
    summaries = {s.id: s.summary() for s in (await store.list("a", 10)).sessions}
    assert summaries[parent.id]["source"] == "ui" and summaries[parent.id]["pinned"]
    assert (summaries[fork.id]["parent_id"], summaries[fork.id]["forked_at_turn"]) == (
        parent.id,
        2,
    )
    assert summaries[fork.id]["source"] == "api" and not summaries[fork.id]["pinned"]


async def test_search_reads_each_store_through_its_contract(store):  # noqa: F811
    texts = ["a walk by the Sea", "nothing to see", "the SEA again"]
    for i, text in enumerate(texts):
        session = Session(id=new_session_id(), owner="a", title=f"t{i}", created_at=1000.0 + i)
        session.messages = [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": text},
        ]
        assert await store.create(session)
    assert await store.create(
        Session(id=new_session_id(), owner="b", title="the sea of b", created_at=2000.0)
    )
    mine = await all_summaries(store, "a", max_sessions=10)
    assert [s.title for s in mine] == ["t2", "t1", "t0"]
    found, has_more = await search(store, mine, "sea", limit=10)
    assert [f["title"] for f in found] == ["t2", "t0"] and not has_more
    assert found[0]["snippet"] == "the SEA again"


async def test_sqlite_file_of_an_older_server_gains_the_new_columns(tmp_path):
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE sessions (id TEXT PRIMARY KEY, owner TEXT NOT NULL, title TEXT NOT NULL, "
        "system TEXT, preset TEXT, cache_salt TEXT, created_at REAL NOT NULL, updated_at REAL NOT "
        "NULL, revision TEXT NOT NULL, num_messages INTEGER NOT NULL, messages TEXT NOT NULL, "
        "token_ids TEXT NOT NULL, block_hashes TEXT NOT NULL, stats TEXT NOT NULL, expires_at REAL "
        "NOT NULL)"
    )
    db.execute(
        "INSERT INTO sessions VALUES ('OlderSession0000000001', 'a', 'old', NULL, NULL, NULL, 1, 1,"
        " 'r', 0, '[]', '[]', '[]', '{}', ?)",
        (time.time() + TTL_S,),
    )
    db.commit()
    db.close()
    sqlite_store = SQLiteSessionStore(path, TTL_S)
    try:
        old = await sqlite_store.get("OlderSession0000000001", "a")
        assert old is not None and old.source == "api" and not old.pinned
        assert old.parent_id is None
    finally:
        await sqlite_store.close()


# over HTTP ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with session_app() as client:
        yield client


def imported(client: TestClient, body: dict, key: str = "alice") -> dict:
    response = client.post("/v1/sessions/import", json=body, headers=auth(key))
    assert response.status_code == 201, response.text
    return response.json()


def chat(title: str, *texts: str, **fields) -> dict:
    roles = ("user", "assistant") * len(texts)
    return {
        "title": title,
        "messages": [{"role": r, "content": t} for r, t in zip(roles, texts)],
        **fields,
    }


def listed(client: TestClient, key: str = "alice", **params) -> dict:
    response = client.get("/v1/sessions", params=params, headers=auth(key))
    assert response.status_code == 200, response.text
    return response.json()


def ids(listing: dict) -> list[str]:
    return [s["id"] for s in listing["data"]]


@pytest.mark.slow
def test_source_filter_and_pins_first(client: TestClient):
    ui = imported(client, chat("from the ui", "hello", "hi", source="ui"))
    api = imported(client, chat("from a script", "hello", "hi"))
    assert (ui["source"], api["source"]) == ("ui", "api")
    assert ui["id"] in ids(listed(client, source="ui"))
    assert api["id"] not in ids(listed(client, source="ui"))
    assert api["id"] in ids(listed(client, source="api"))

    assert ids(listed(client))[0] == api["id"]  # the newest
    pinned = client.patch(f"/v1/sessions/{ui['id']}", json={"pinned": True}, headers=auth())
    assert pinned.status_code == 200 and pinned.json()["pinned"] is True
    assert ids(listed(client))[0] == ui["id"]
    assert client.get(f"/v1/sessions/{ui['id']}", headers=auth()).json()["pinned"] is True
    client.patch(f"/v1/sessions/{ui['id']}", json={"pinned": False}, headers=auth())
    assert ids(listed(client))[0] == api["id"]

    bad = client.get("/v1/sessions", params={"source": "import"}, headers=auth())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "source"
    created = client.post("/v1/sessions", json={"source": "web"}, headers=auth())
    assert created.status_code == 400 and created.json()["error"]["param"] == "source"


@pytest.mark.slow
def test_search_finds_titles_and_messages_of_own_sessions(client: TestClient):
    word = "Quokkas"
    in_reply = imported(
        client, chat("animals", "Which animal smiles?", f"The {word.lower()} of Rottnest island.")
    )
    in_title = imported(client, chat(f"All about {word}", "hello", "hi"))
    imported(client, chat("other", "nothing here", "nor here"))
    imported(client, chat("bob's", "quokkas too", "yes"), key="bob")

    found = listed(client, q=word.upper())
    assert ids(found) == [in_title["id"], in_reply["id"]]  # newest first, only alice's
    snippets = [s["snippet"] for s in found["data"]]
    assert word.lower() in snippets[1].lower() and "Rottnest" in snippets[1]
    assert word in snippets[0]
    assert ids(listed(client, q=word, limit=1)) == [in_title["id"]]
    assert listed(client, q=word, limit=1)["has_more"] is True
    assert listed(client, q="no such text anywhere")["data"] == []

    long = client.get("/v1/sessions", params={"q": "x" * 201}, headers=auth())
    assert long.status_code == 400 and long.json()["error"]["param"] == "q"


@pytest.mark.slow
def test_export_then_import_gives_the_same_messages_and_a_turn_extends_them(client: TestClient):
    original = imported(
        client, chat("A/B: test?", "Name a colour.", "Blue.", "Name a fruit.", "Apple.")
    )
    exported = client.get(f"/v1/sessions/{original['id']}/export", headers=auth())
    assert exported.status_code == 200
    assert "attachment" in exported.headers["content-disposition"]
    body = exported.json()
    assert (body["object"], body["version"], body["title"]) == ("session.export", 1, "A/B: test?")
    assert all(isinstance(m["tokens"], int) and m["tokens"] > 0 for m in body["messages"])

    again = imported(client, body)
    pairs = [(m["role"], m["content"]) for m in again["messages"]]
    assert pairs == [(m["role"], m["content"]) for m in original["messages"]]

    reply = client.post(
        f"/v1/sessions/{again['id']}/messages",
        json={"content": "Name a planet.", "max_tokens": 4, "temperature": 0},
        headers=auth(),
    )
    assert reply.status_code == 200, reply.text
    deadline = time.monotonic() + 30
    while len(export(client, again["id"])["messages"]) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    after = export(client, again["id"])
    assert len(after["messages"]) == 6
    # the turn extended the imported ids exactly: every earlier message's tokens still known, unchanged
    assert [m["tokens"] for m in after["messages"][:4]] == [m["tokens"] for m in body["messages"]]

    markdown = client.get(
        f"/v1/sessions/{original['id']}/export", params={"format": "markdown"}, headers=auth()
    )
    assert markdown.status_code == 200
    assert 'filename="A-B-test.md"' in markdown.headers["content-disposition"]
    text = markdown.text
    assert text.index("## User") < text.index("Name a colour.") < text.index("## Assistant")
    bad = client.get(f"/v1/sessions/{original['id']}/export?format=pdf", headers=auth())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "format"
    assert (
        client.get(f"/v1/sessions/{original['id']}/export", headers=auth("bob")).status_code == 404
    )


def export(client: TestClient, session_id: str) -> dict:
    return client.get(f"/v1/sessions/{session_id}/export", headers=auth()).json()


@pytest.mark.slow
@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "assistant", "content": "first"}],
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
        [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}],
        [],
        # over the model's context (1024 tokens)
        [{"role": "user", "content": "lorem ipsum " * 800}, {"role": "assistant", "content": "ok"}],
    ],
)
def test_import_refuses_bad_messages(client: TestClient, messages: list[dict]):
    response = client.post("/v1/sessions/import", json={"messages": messages}, headers=auth())
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("messages")


@pytest.mark.slow
def test_reasoning_is_collapsed_in_markdown(client: TestClient):
    body = chat("thinking", "Why?", "Because.")
    body["messages"][1]["reasoning_content"] = "Let me think."
    session = imported(client, body)
    markdown = client.get(
        f"/v1/sessions/{session['id']}/export", params={"format": "markdown"}, headers=auth()
    ).text
    assert "<details><summary>Reasoning</summary>\n\nLet me think." in markdown
