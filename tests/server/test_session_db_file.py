"""The SQLite session database's file (app/sessions/sqlite_file.py): created 0600 with its -wal and -shm, in a
directory made 0700; a corrupt file refused at start naming session_db_path; and while serving, a file deleted,
a disk full or a write failing makes the store unavailable (its ping fails: /health says "unavailable", writes
get SessionStoreUnavailable: 503) with one log line, and a file put back makes it usable again."""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
from pathlib import Path

import pytest

from app.sessions import sqlite_file
from app.sessions.sqlite_file import check_database
from app.sessions.sqlite_store import SQLiteSessionStore
from app.sessions.store import Session, SessionStoreUnavailable, new_session_id

TTL_S = 3600


def mode(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def said_by_the_file(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == sqlite_file.__name__]


@pytest.fixture
async def store(tmp_path: Path):
    store = SQLiteSessionStore(tmp_path / "private" / "sessions.sqlite3", TTL_S)
    yield store
    await store.close()


async def test_the_database_and_its_wal_and_shm_are_0600_in_a_0700_directory(store):
    assert await store.create(Session(id=new_session_id(), owner="a"))
    for suffix in ("", "-wal", "-shm"):
        assert mode(f"{store.path}{suffix}") == 0o600, suffix
    assert mode(store.path.parent) == 0o700


async def test_a_database_left_open_to_others_is_made_private(tmp_path: Path):
    path = tmp_path / "sessions.sqlite3"
    sqlite3.connect(path).close()
    path.chmod(0o644)
    store = SQLiteSessionStore(path, TTL_S)
    try:
        await store.ping()
        assert mode(path) == 0o600
    finally:
        await store.close()


# the file at start ------------------------------------------------------------------------------------------


def test_a_corrupt_database_is_a_value_error_naming_the_option(tmp_path: Path):
    path = tmp_path / "sessions.sqlite3"
    path.write_bytes(b"this is not a database, " * 100)
    with pytest.raises(ValueError, match=r"^session_db_path: .* is not a usable SQLite database"):
        check_database(path)


async def test_a_sound_or_missing_database_passes_the_check(store, tmp_path: Path):
    check_database(tmp_path / "none-yet.sqlite3")
    assert not (tmp_path / "none-yet.sqlite3").exists()
    assert await store.create(Session(id=new_session_id(), owner="a"))
    check_database(store.path)


# the file while serving -------------------------------------------------------------------------------------


async def test_a_database_deleted_while_serving_is_unavailable_with_one_log_line(store, caplog):
    session = Session(id=new_session_id(), owner="a")
    assert await store.create(session)
    await store.ping()
    store.path.unlink()
    with caplog.at_level(logging.ERROR, logger=sqlite_file.__name__):
        with pytest.raises(SessionStoreUnavailable, match="was deleted while serving"):
            await store.ping()
        with pytest.raises(SessionStoreUnavailable, match="was deleted while serving"):
            await store.create(Session(id=new_session_id(), owner="a"))
        with pytest.raises(SessionStoreUnavailable):
            await store.ping()
    said = said_by_the_file(caplog)
    assert len(said) == 1 and "deleted while serving" in said[0] and str(store.path) in said[0]


async def test_a_database_put_back_is_opened_again(store, tmp_path: Path):
    session = Session(id=new_session_id(), owner="a")
    assert await store.create(session)
    backup = tmp_path / "backup.sqlite3"
    source, target = sqlite3.connect(store.path), sqlite3.connect(backup)
    source.backup(target)
    source.close()
    target.close()
    store.path.unlink()
    with pytest.raises(SessionStoreUnavailable):
        await store.ping()
    backup.rename(store.path)
    await store.ping()
    assert (await store.get(session.id, "a")).id == session.id


async def test_a_full_database_fails_writes_and_ping_until_a_write_succeeds(store, caplog):
    assert await store.create(Session(id=new_session_id(), owner="a"))

    def cap_pages(db: sqlite3.Connection, extra: int) -> None:
        (pages,) = db.execute("PRAGMA page_count").fetchone()
        db.execute(f"PRAGMA max_page_count = {pages + extra}")

    await store._run(cap_pages, 0)  # (SQLite's own SQLITE_FULL, as on a full disk)
    big = Session(id=new_session_id(), owner="a", system="x" * 100_000)
    with caplog.at_level(logging.WARNING, logger=sqlite_file.__name__):
        with pytest.raises(SessionStoreUnavailable, match="full"):
            await store.create(big)
        with pytest.raises(SessionStoreUnavailable, match="full"):
            await store.ping()
        assert (await store.list("a", 10)).sessions  # reads still work, and do not clear it
        with pytest.raises(SessionStoreUnavailable):
            await store.ping()
        await store._run(cap_pages, 1000)
        assert await store.create(big)
        await store.ping()
    said = said_by_the_file(caplog)
    assert [m.split(":")[0] for m in said] == ["sessions unavailable", "sessions available again"]


async def test_a_disk_without_free_space_makes_ping_fail(store, monkeypatch):
    await store.ping()
    monkeypatch.setattr(sqlite_file, "MIN_FREE_BYTES", 1 << 62)  # more than any disk has free
    with pytest.raises(SessionStoreUnavailable, match="is full"):
        await store.ping()


def _open_at_once(path: str, barrier, results) -> None:
    """One front's store opening the file as the others do (a forked process)."""
    store = SQLiteSessionStore(path, TTL_S)
    barrier.wait()
    try:
        store._connection()
        results.put(None)
    except Exception as exc:  # noqa: BLE001 - the test reports it
        results.put(f"{type(exc).__name__}: {exc}")


def test_fronts_opening_a_new_database_at_the_same_instant_all_open_it(tmp_path: Path):
    """`--api-server-count 2` on a fresh file: the fronts race to switch it to WAL and the losers were told
    "database is locked" at once (a front then failed to start, half the time in 3-process trials); now each
    opening is tried again until the winner is done."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    for trial in range(10):
        path = str(tmp_path / f"fresh-{trial}.sqlite3")
        barrier, results = context.Barrier(3), context.Queue()
        fronts = [
            context.Process(target=_open_at_once, args=(path, barrier, results)) for _ in range(3)
        ]
        for front in fronts:
            front.start()
        outcomes = [results.get(timeout=60) for _ in fronts]
        for front in fronts:
            front.join(10)
        assert outcomes == [None, None, None], (trial, outcomes)


def test_an_opening_is_tried_again_while_locked_and_other_errors_are_raised_at_once(tmp_path: Path):
    locked = sqlite3.OperationalError("database is locked")
    locked.sqlite_errorcode = sqlite3.SQLITE_BUSY
    calls = []

    def prepare(db: sqlite3.Connection) -> None:
        calls.append(db)
        if len(calls) < 3:
            raise locked

    db = sqlite_file.open_database(tmp_path / "a.sqlite3", prepare)
    assert len(calls) == 3 and db is calls[-1]
    db.close()
    broken = sqlite3.OperationalError("no such table: x")

    def fails(db: sqlite3.Connection) -> None:
        calls.append(db)
        raise broken

    calls.clear()
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        sqlite_file.open_database(tmp_path / "b.sqlite3", fails)
    assert len(calls) == 1
