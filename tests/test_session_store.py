"""Session stores, in memory and in a real Redis: the same behaviour behind the SessionStore protocol —
owners see only their sessions, listing is newest first, a turn is written whole and never resurrects a
deleted session, a rename during a turn survives it, locks exclude and expire, and a lost Redis is reported
as SessionStoreUnavailable (then works again when it returns)."""
from __future__ import annotations

import asyncio

import pytest

from app.sessions import (InMemorySessionStore, Preset, RedisSessionStore, Session, SessionStoreUnavailable,
                          is_session_id, new_session_id)
from tests.redis_harness import RedisServer, running_redis

TTL_S = 3600


@pytest.fixture(scope="module")
def redis_server():
    with running_redis() as server:
        yield server


@pytest.fixture(params=["memory", "redis"])
async def store(request, redis_server: RedisServer):
    if request.param == "memory":
        yield InMemorySessionStore(TTL_S)
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
        await store.create(Session(id=new_session_id(), owner=owner, title=f"t{i}", created_at=1000.0 + i))
    listed = await store.list("a", limit=10)
    assert [s.title for s in listed] == ["t3", "t2", "t0"]
    assert [s.title for s in await store.list("a", limit=2)] == ["t3", "t2"]
    foreign = (await store.list("b", 10))[0]
    assert await store.get(foreign.id, "a") is None and await store.get(foreign.id, "b") is not None
    assert not await store.delete(foreign.id, "a") and not await store.set_title(foreign.id, "a", "x")


async def test_turn_is_written_whole_and_keeps_a_concurrent_rename(store):
    session = Session(id=new_session_id(), system="be brief", cache_salt="s1")
    await store.create(session)
    turn = await store.get(session.id, "")
    await store.set_title(session.id, "", "renamed meanwhile")
    turn.messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    turn.token_ids, turn.block_hashes, turn.stats = [5, 6, 7], ["ab" * 32], {"num_turns": 1}
    turn.updated_at = session.created_at + 5
    token = await store.lock(session.id, ttl_s=30)
    assert await store.save_turn(turn, token)
    stored = await store.get(session.id, "")
    assert (stored.messages, stored.token_ids, stored.block_hashes, stored.stats) == (
        turn.messages, [5, 6, 7], ["ab" * 32], {"num_turns": 1})
    assert stored.title == "renamed meanwhile" and stored.system == "be brief" and stored.cache_salt == "s1"
    assert (await store.list("", 10))[0].summary()["num_messages"] == 2


async def test_a_turn_ending_after_delete_does_not_resurrect_the_session(store):
    session = Session(id=new_session_id())
    await store.create(session)
    token = await store.lock(session.id, ttl_s=30)
    assert await store.delete(session.id, "")
    session.messages = [{"role": "user", "content": "late"}]
    assert not await store.save_turn(session, token)
    assert await store.get(session.id, "") is None and await store.list("", 10) == []


async def test_a_turn_whose_lock_expired_cannot_overwrite_a_later_turn(store):
    session = Session(id=new_session_id())
    await store.create(session)
    stale_token = await store.lock(session.id, ttl_s=0.2)
    await asyncio.sleep(0.3)  # e.g. Redis was away longer than the lock: another turn may have started
    later_token = await store.lock(session.id, ttl_s=30)
    later = await store.get(session.id, "")
    later.messages = [{"role": "user", "content": "later turn"}]
    assert await store.save_turn(later, later_token)
    stale = await store.get(session.id, "")
    stale.messages = [{"role": "user", "content": "stale turn"}]
    assert not await store.save_turn(stale, stale_token)
    assert (await store.get(session.id, "")).messages == [{"role": "user", "content": "later turn"}]


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


async def test_presets(store):
    await store.save_preset(Preset("pirate", "Talk like a pirate."))
    await store.save_preset(Preset("brief", "Be brief."))
    assert [p.name for p in await store.list_presets()] == ["brief", "pirate"]
    assert (await store.get_preset("pirate")).system == "Talk like a pirate."
    assert await store.delete_preset("pirate") and not await store.delete_preset("pirate")
    assert await store.get_preset("pirate") is None


async def test_redis_sessions_expire_unless_used(redis_server: RedisServer):
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
        assert await store.list("", 10) == [] and client.zcard("pagedchat:sessions:-") == 0
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
        assert (await store.get(session.id, "")).title == "kept"  # AOF: nothing already stored is lost
    finally:
        await store.close()
