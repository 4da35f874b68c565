"""Processes around a benchmark: the resident memory of a served process tree (the front, the engine core, the
grammar workers), read from /proc, and busy neighbours (other work on a shared machine)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path


def resident_by_name(pid: int) -> dict[str, int]:
    """Resident bytes of process ``pid`` and its descendants, by process name (``pagedchat``, ``pagedchat-core``,
    ``pagedchat-gramm``, ...; processes of one name summed); a process that ends meanwhile is left out."""
    by_name: dict[str, int] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            status = dict(
                line.split(":", 1) for line in Path(f"/proc/{p}/status").read_text().splitlines()
            )
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        name = status["Name"].strip()
        by_name[name] = by_name.get(name, 0) + int(status["VmRSS"].split()[0]) * 1024
    return by_name


@contextlib.contextmanager
def neighbours(count: int) -> Iterator[list[int]]:
    """``count`` processes that keep a CPU busy (``python -c "while True: pass"``), as other work on a shared
    machine does, running before the measured work starts; their pids."""
    processes = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(count)
    ]
    try:
        if processes:
            time.sleep(1.0)
        yield [p.pid for p in processes]
    finally:
        for process in processes:
            process.kill()
            process.wait()
