"""Session stores, in memory, in a real Redis and in a SQLite file: the same behaviour behind the SessionStore protocol —
owners see only their sessions, listing is newest first and paged, creation never overwrites a taken id and
respects the per-owner cap, a turn is written whole and never resurrects a deleted session nor overwrites a later
turn, a rename during a turn survives it, a new system prompt resets the stored ids (and a turn begun before it
stores nothing), locks exclude and expire, presets belong to their owner or are shared,
and a lost Redis is reported as SessionStoreUnavailable (then works again when it returns)."""

from __future__ import annotations

import asyncio

import pytest

from app.sessions import (
    InMemorySessionStore,
    Preset,
    RedisSessionStore,
    Session,
    SessionQuotaExceeded,
    SessionStoreUnavailable,
    SQLiteSessionStore,
    UnknownCursor,
    is_session_id,
    new_session_id,
)
from tests.redis_harness import RedisServer

TTL_S = 3600


@pytest.fixture(params=["memory", "redis", "sqlite"])
async def store(request, redis_server: RedisServer, tmp_path):
    if request.param == "memory":
        yield InMemorySessionStore(TTL_S)
        return
    if request.param == "sqlite":
        store = SQLiteSessionStore(tmp_path / "sessions.sqlite3", TTL_S)
        yield store
        await store.close()
        return
    redis_server.client().flushall()
    store = RedisSessionStore(redis_server.url, TTL_S)
    yield store
    await store.close()


def test_session_ids_are_128_random_bits_url_safe():
    ids = {new_session_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(is_session_id(i) and len(i) == 22 for i in ids)
    assert not is_session_id("../../etc/passwd-xxxxx") and not is_session_id("short")


async def test_owners_see_only_their_sessions_newest_first(store):
    for i, owner in enumerate(["a", "b", "a", "a"]):
        await store.create(
            Session(id=new_session_id(), owner=owner, title=f"t{i}", created_at=1000.0 + i)
        )
    listed = (await store.list("a", limit=10)).sessions
    assert [s.title for s in listed] == ["t3", "t2", "t0"]
    assert [s.title for s in (await store.list("a", limit=2)).sessions] == ["t3", "t2"]
    foreign = (await store.list("b", 10)).sessions[0]
    assert await store.get(foreign.id, "a") is None and await store.get(foreign.id, "b") is not None
    assert not await store.delete(foreign.id, "a") and not await store.set_title(
        foreign.id, "a", "x"
    )


async def test_turn_is_written_whole_and_keeps_a_concurrent_rename(store):
    session = Session(id=new_session_id(), system="be brief", cache_salt="s1")
    await store.create(session)
    turn = await store.get(session.id, "")
    await store.set_title(session.id, "", "renamed meanwhile")
    turn.messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    turn.token_ids, turn.block_hashes, turn.stats = [5, 6, 7], ["ab" * 32], {"num_turns": 1}
    turn.updated_at = session.created_at + 5
    assert await store.save_turn(turn)
    stored = await store.get(session.id, "")
    assert (stored.messages, stored.token_ids, stored.block_hashes, stored.stats) == (
        turn.messages,
        [5, 6, 7],
        ["ab" * 32],
        {"num_turns": 1},
    )
    assert (
        stored.title == "renamed meanwhile"
        and stored.system == "be brief"
        and stored.cache_salt == "s1"
    )
    assert (await store.list("", 10)).sessions[0].summary()["num_messages"] == 2


async def test_a_turn_or_rename_after_delete_does_not_resurrect_the_session(store):
    session = Session(id=new_session_id())
    await store.create(session)
    turn = await store.get(session.id, "")
    assert await store.delete(session.id, "")
    turn.messages = [{"role": "user", "content": "late"}]
    assert not await store.save_turn(turn)
    assert not await store.set_title(session.id, "", "a late rename")
    assert await store.get(session.id, "") is None and (await store.list("", 10)).sessions == []


async def test_a_turn_finishing_after_its_id_was_taken_again_stores_nothing(store):
    session = Session(id=new_session_id(), owner="a")
    await store.create(session)
    turn = await store.get(session.id, "a")
    assert await store.delete(session.id, "a")
    assert await store.create(Session(id=session.id, owner="a", title="reborn"))
    turn.messages = [{"role": "user", "content": "from the deleted session"}]
    assert not await store.save_turn(turn)
    assert (await store.get(session.id, "a")).messages == []


async def test_a_stale_turn_cannot_overwrite_a_later_turn(store):
    session = Session(id=new_session_id())
    await store.create(session)
    # e.g. its lock expired while Redis was away, and another turn ran
    stale = await store.get(session.id, "")
    later = await store.get(session.id, "")
    later.messages = [{"role": "user", "content": "later turn"}]
    assert await store.save_turn(later)
    stale.messages = [{"role": "user", "content": "stale turn"}]
    assert not await store.save_turn(stale)
    assert (await store.get(session.id, "")).messages == [{"role": "user", "content": "later turn"}]
    later.messages.append({"role": "assistant", "content": "its next turn"})
    assert await store.save_turn(later)  # the writer's copy follows its own writes


async def test_a_new_system_prompt_resets_the_ids_and_a_turn_begun_before_stores_nothing(store):
    session = Session(id=new_session_id(), owner="a", system="be brief", preset="brief")
    await store.create(session)
    first = await store.get(session.id, "a")
    first.messages = [
        {"role": "user", "content": "hi", "token_end": 9},
        {"role": "assistant", "content": "hello", "token_end": 12},
    ]
    first.token_ids, first.block_hashes = list(range(12)), ["cd" * 32]
    assert await store.save_turn(first)
    turn = await store.get(session.id, "a")  # a turn that began before the change
    changed = await store.get(session.id, "a")
    changed.reset_system("be verbose")
    assert await store.set_system(changed)
    stored = await store.get(session.id, "a")
    assert (stored.system, stored.preset, stored.token_ids, stored.block_hashes) == (
        "be verbose",
        None,
        [],
        [],
    )
    assert stored.messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    turn.token_ids = list(range(20))  # rendered with the old prompt
    assert not await store.save_turn(turn)
    assert (await store.get(session.id, "a")).token_ids == []
    cleared = await store.get(session.id, "a")
    cleared.reset_system(None)
    assert await store.set_system(cleared)
    assert (await store.get(session.id, "a")).system is None


async def test_creation_never_overwrites_a_taken_id(store):
    session_id = new_session_id()
    assert await store.create(Session(id=session_id, owner="a", system="first"))
    assert not await store.create(Session(id=session_id, owner="b", system="second"))
    assert (
        await store.create_locked(Session(id=session_id, owner="a", system="third"), lock_ttl_s=30)
        is None
    )
    assert (await store.get(session_id, "a")).system == "first" and await store.get(
        session_id, "b"
    ) is None


async def test_concurrent_locked_creations_of_one_id_make_one_session_holding_its_lock(store):
    session_id = new_session_id()
    candidates = [Session(id=session_id, owner="a", system=f"system {i}") for i in range(3)]
    tokens = await asyncio.gather(*(store.create_locked(s, lock_ttl_s=30) for s in candidates))
    winners = [i for i, token in enumerate(tokens) if token is not None]
    assert len(winners) == 1
    assert (await store.get(session_id, "a")).system == f"system {winners[0]}"
    assert await store.lock(session_id, ttl_s=30) is None  # the creator holds the turn's lock
    await store.unlock(session_id, tokens[winners[0]])
    assert await store.lock(session_id, ttl_s=30) is not None


async def test_each_owner_keeps_at_most_its_cap_of_sessions(store):
    for i in range(3):
        assert await store.create(Session(id=new_session_id(), owner="a"), max_sessions=3)
    with pytest.raises(SessionQuotaExceeded):
        await store.create(Session(id=new_session_id(), owner="a"), max_sessions=3)
    with pytest.raises(SessionQuotaExceeded):
        await store.create_locked(
            Session(id=new_session_id(), owner="a"), lock_ttl_s=30, max_sessions=3
        )
    # another owner's count
    assert await store.create(Session(id=new_session_id(), owner="b"), max_sessions=3)
    first = (await store.list("a", 10)).sessions[0]
    assert await store.delete(first.id, "a")
    assert await store.create(Session(id=new_session_id(), owner="a"), max_sessions=3)


async def test_listing_is_paged_with_an_after_cursor(store):
    ids = [new_session_id() for _ in range(7)]
    for i, session_id in enumerate(ids):
        await store.create(Session(id=session_id, owner="a", created_at=2000.0 + i))
    await store.create(Session(id=new_session_id(), owner="b", created_at=3000.0))
    seen, after, pages = [], None, 0
    while True:
        page = await store.list("a", 3, after)
        seen += [s.id for s in page.sessions]
        pages += 1
        if not page.has_more:
            break
        after = page.sessions[-1].id
    assert seen == ids[::-1] and pages == 3
    with pytest.raises(UnknownCursor):
        await store.list("b", 3, after=ids[0])  # another owner's id is no cursor here


async def test_locks_exclude_expire_and_only_their_holder_releases_them(store):
    token = await store.lock("sid", ttl_s=0.3)
    assert token is not None and await store.lock("sid", ttl_s=0.3) is None
    await store.unlock("sid", "not-the-token")
    assert await store.lock("sid", ttl_s=0.3) is None
    assert await store.refresh_lock("sid", token, ttl_s=0.3)
    await asyncio.sleep(0.45)
    second = await store.lock("sid", ttl_s=5)
    assert second is not None and not await store.refresh_lock("sid", token, 5)
    await store.unlock("sid", second)
    assert await store.lock("sid", ttl_s=5) is not None


async def test_presets_are_their_owners_or_shared(store):
    assert await store.save_preset(Preset("pirate", "Talk like a pirate."))  # shared
    assert await store.save_preset(Preset("brief", "Be brief.", owner="a"))
    assert await store.save_preset(Preset("pirate", "A's own pirate.", owner="a"))
    assert not await store.save_preset(Preset("brief", "Taken.", owner="a"))
    assert [(p.name, p.owner) for p in await store.list_presets("a")] == [
        ("brief", "a"),
        ("pirate", ""),
        ("pirate", "a"),
    ]
    assert [(p.name, p.owner) for p in await store.list_presets("b")] == [("pirate", "")]
    assert len(await store.list_presets(None)) == 3
    # its own before the shared one
    assert (await store.get_preset("pirate", "a")).system == "A's own pirate."
    assert (await store.get_preset("pirate", "b")).system == "Talk like a pirate."
    assert await store.get_preset("brief", "b") is None
    own = await store.get_preset("pirate", "a")
    assert await store.delete_preset(own) and not await store.delete_preset(own)
    assert (await store.get_preset("pirate", "a")).system == "Talk like a pirate."


async def test_redis_sessions_expire_unless_used(redis_server: RedisServer):
    redis_server.client().flushall()  # (the module's other tests leave sessions behind)
    store = RedisSessionStore(redis_server.url, ttl_s=60)
    try:
        session = Session(id=new_session_id())
        await store.create(session)
        key = f"pagedchat:session:{session.id}"
        client = redis_server.client()
        client.pexpire(key, 5000)
        await store.get(session.id, "")  # use refreshes the TTL
        assert 55_000 < client.pttl(key) <= 60_000
        client.delete(key)  # as if it had expired: the listing forgets it too
        assert (await store.list("", 10)).sessions == [] and client.zcard(
            "pagedchat:sessions:-"
        ) == 0
    finally:
        await store.close()


async def test_lost_redis_is_reported_and_recovered(redis_server: RedisServer):
    store = RedisSessionStore(redis_server.url, TTL_S)
    try:
        session = Session(id=new_session_id(), title="kept")
        await store.create(session)
        redis_server.stop()
        with pytest.raises(SessionStoreUnavailable):
            await store.get(session.id, "")
        with pytest.raises(SessionStoreUnavailable):
            await store.ping()
        redis_server.start()
        # AOF: nothing already stored is lost
        assert (await store.get(session.id, "")).title == "kept"
    finally:
        await store.close()


async def test_redis_cap_does_not_count_expired_sessions(redis_server: RedisServer):
    redis_server.client().flushall()
    store = RedisSessionStore(redis_server.url, TTL_S)
    try:
        kept, expiring = (
            Session(id=new_session_id(), owner="a"),
            Session(id=new_session_id(), owner="a"),
        )
        assert await store.create(kept, max_sessions=2) and await store.create(
            expiring, max_sessions=2
        )
        # as if its TTL had run out
        redis_server.client().delete(f"pagedchat:session:{expiring.id}")
        assert await store.create(Session(id=new_session_id(), owner="a"), max_sessions=2)
        with pytest.raises(SessionQuotaExceeded):
            await store.create(Session(id=new_session_id(), owner="a"), max_sessions=2)
    finally:
        await store.close()


async def test_sqlite_sessions_survive_a_reopen_and_two_stores_on_one_file_share_them(tmp_path):
    path = tmp_path / "sessions.sqlite3"
    first = SQLiteSessionStore(path, TTL_S)
    session = Session(id=new_session_id(), owner="a", title="kept", system="be brief")
    assert await first.create(session)
    turn = await first.get(session.id, "a")
    turn.messages, turn.token_ids = [{"role": "user", "content": "hi"}], [1, 2, 3]
    assert await first.save_turn(turn)
    await first.save_preset(Preset("terse", "Answer tersely."))
    await first.close()
    # (as two front processes)
    second, third = SQLiteSessionStore(path, TTL_S), SQLiteSessionStore(path, TTL_S)
    try:
        reopened = await second.get(session.id, "a")
        assert (reopened.title, reopened.messages, reopened.token_ids) == (
            "kept",
            turn.messages,
            [1, 2, 3],
        )
        assert [p.name for p in await third.list_presets(None)] == ["terse"]
        token = await second.lock(session.id, 30)
        # one turn at a time, across both
        assert token is not None and await third.lock(session.id, 30) is None
        stale = await third.get(session.id, "a")
        assert await second.save_turn(reopened) and not await third.save_turn(stale)
    finally:
        await second.close()
        await third.close()


async def test_an_unusable_sqlite_file_is_unavailable_not_a_crash(tmp_path):
    (tmp_path / "not-a-dir").write_text("x")
    store = SQLiteSessionStore(tmp_path / "not-a-dir" / "sessions.sqlite3", TTL_S)
    with pytest.raises(SessionStoreUnavailable, match="cannot be used"):
        await store.ping()
    await store.close()
