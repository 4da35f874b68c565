"""The session database's file (app/sessions/sqlite_store.py): created private, checked at start, watched while
serving.

- Private: the file is created 0600 (SQLite gives its -wal and -shm files the main file's mode) and its directory,
  when the store creates it, 0700: every tenant's chats are in it. A file found open to other users is made 0600.
- Checked at start: a file that is not a SQLite database (or whose header or schema is corrupt) is a ValueError
  naming ``session_db_path``, which ``pagedchat serve`` says in one line before exiting with status 2.
- Opened by several fronts at once (``open_database``): fronts that open a new file at the same instant race to
  switch it to WAL, and the losers' switch answers "database is locked" at once (SQLite does not wait its busy
  timeout there: waiting could deadlock); the opening is then tried again, for up to ``OPEN_WAIT_S``.
- Watched: a file deleted or replaced while serving, a full disk, a write that fails with an I/O error: the store
  is unavailable (its ping fails, so /health says ``"sessions": "unavailable"``, and session routes answer 503)
  rather than answering 200 for writes to a file nobody will read again. The first sign is one log line; so is
  the recovery.
"""

from __future__ import annotations

import logging
import os
import random
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

FILE_MODE = 0o600
DIR_MODE = 0o700
SIDE_FILES = ("-wal", "-shm")
# below this much free space where the file lives, the disk counts as full (a turn's write would fail)
MIN_FREE_BYTES = 1 << 20
OPEN_WAIT_S = 10.0  # how long an opening is tried again while other fronts open the same new file
# errors of the file rather than of one call: full, I/O error, read-only, cannot open, corrupt, not a database
_FILE_FAULTS = {
    sqlite3.SQLITE_FULL,
    sqlite3.SQLITE_IOERR,
    sqlite3.SQLITE_READONLY,
    sqlite3.SQLITE_CANTOPEN,
    sqlite3.SQLITE_CORRUPT,
    sqlite3.SQLITE_NOTADB,
}


def create_private(path: Path) -> None:
    """The file (empty: SQLite makes it a database) with mode 0600, its directory 0700 when it is new."""
    if not path.parent.is_dir():
        path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE))
    for name in (str(path), *(f"{path}{suffix}" for suffix in SIDE_FILES)):
        try:
            mode = os.stat(name).st_mode & 0o777
            if mode & ~FILE_MODE:
                os.chmod(name, FILE_MODE)
                logger.warning(
                    "the session database file %s was open to other users (mode %o): made %o",
                    name,
                    mode,
                    FILE_MODE,
                )
        except FileNotFoundError:
            continue
        except PermissionError as exc:  # another user's file: say so, the store may still read it
            logger.warning("the session database file %s cannot be made private: %s", name, exc)


def open_database(path: Path, prepare: Callable[[sqlite3.Connection], None]) -> sqlite3.Connection:
    """A connection to ``path`` (autocommit, usable from the store's thread) with ``prepare`` run on it (journal
    mode, schema), tried again while it answers "database is locked" (another front opening the file), for up to
    ``OPEN_WAIT_S``."""
    deadline = time.monotonic() + OPEN_WAIT_S
    while True:
        db = sqlite3.connect(path, timeout=5, isolation_level=None, check_same_thread=False)
        try:
            prepare(db)
            return db
        except sqlite3.OperationalError as exc:
            db.close()
            busy = getattr(exc, "sqlite_errorcode", 0) & 0xFF in (
                sqlite3.SQLITE_BUSY,
                sqlite3.SQLITE_LOCKED,
            )
            if not busy or time.monotonic() >= deadline:
                raise
        except BaseException:
            db.close()
            raise
        # (apart, so that fronts that collided do not collide again)
        time.sleep(random.uniform(0.01, 0.05))


def check_database(path: str | Path) -> None:
    """ValueError naming session_db_path when an existing file is not a usable SQLite database (a missing one is
    created at first use). Reads the header and the schema only: seconds for no size of file."""
    path = Path(path)
    if not path.exists():
        return
    try:
        db = sqlite3.connect(path, timeout=5)
        try:
            db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        if not is_file_fault(exc):
            raise
        raise ValueError(
            f"session_db_path: {path} is not a usable SQLite database ({exc}); move it away to start "
            "with no sessions, or restore it from a backup"
        ) from None


def is_file_fault(exc: BaseException) -> bool:
    """True for an error that says the file (not the call) is unusable."""
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, OSError) or (code is not None and code & 0xFF in _FILE_FAULTS)


@dataclass(frozen=True, slots=True)
class FileIdentity:
    device: int
    inode: int


def identity(path: Path) -> FileIdentity | None:
    """Which file ``path`` names now; None when there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return FileIdentity(st.st_dev, st.st_ino)


class FileWatch:
    """The state of the open file. ``gone()``: the file was deleted since it was opened (nothing written to it
    would be read again). ``problem()``: that, or too little free space beside it, or the last write's error
    (cleared by the next write that succeeds). Each change of state is one log line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.opened: FileIdentity | None = None
        self._write_error: str | None = None
        self._said: str | None = None  # the problem last logged

    def opened_now(self) -> None:
        self.opened = identity(self.path)

    def replaced(self) -> bool:
        """Another file now has the path (restored from a backup, say): it should be opened instead."""
        now = identity(self.path)
        return now is not None and self.opened is not None and now != self.opened

    def gone(self) -> str | None:
        if self.opened is None or identity(self.path) is not None:
            return None
        found = (
            f"the session database {self.path} was deleted while serving: sessions cannot be stored; "
            "restore it, or restart the server to start an empty one"
        )
        self._say(found)
        return found

    def problem(self) -> str | None:
        found = self.gone()
        free = _free_bytes(self.path.parent)
        if found is None and free is not None and free < MIN_FREE_BYTES:
            found = f"the disk of the session database {self.path} is full (under {MIN_FREE_BYTES} bytes free)"
        found = found or self._write_error
        self._say(found)
        return found

    def write_failed(self, exc: BaseException) -> None:
        self._write_error = f"the session database {self.path} failed: {exc}"
        self._say(self._write_error)

    def wrote(self) -> None:
        self._write_error = None
        self._say(None)

    def _say(self, problem: str | None) -> None:
        if problem == self._said:
            return
        if problem is not None:
            logger.error("sessions unavailable: %s", problem)
        else:
            logger.warning("sessions available again: %s is usable", self.path)
        self._said = problem


def _free_bytes(directory: Path) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
