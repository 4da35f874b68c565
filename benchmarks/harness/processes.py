"""Processes around a benchmark: the resident memory of a served process tree (the front, the engine core, the
grammar workers), read from /proc, and busy neighbours (other work on a shared machine)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path


def resident_by_name(
    pid: int, without_kv_pool: bool = False, proportional: bool = False
) -> dict[str, int]:
    """Resident bytes of process ``pid`` and its descendants, by process name (``pagedchat``, ``pagedchat-core``,
    ``pagedchat-gramm``, ...; processes of one name summed); a process that ends meanwhile is left out.
    ``without_kv_pool``: less the KV pool's resident pages (its memfd mappings; their pages are touched as blocks
    are first used, up to the pool's size). ``proportional``: each process's PSS instead of its RSS (a page that n
    processes share counts 1/n in each: the grammar workers share their zygote's tokenizer, so the tree's PSS is
    the memory it takes; its RSS counts those pages once per worker). A child still under its parent's name (forked,
    not yet named: the grammar zygote's worker between ``fork`` and its ``prctl``, its RSS the zygote's pages) is
    counted as ``"<name> (forking)"``."""
    by_name: dict[str, int] = {}
    todo: list[tuple[int, str | None]] = [(pid, None)]
    while todo:
        p, parent = todo.pop()
        try:
            status = dict(
                line.split(":", 1) for line in Path(f"/proc/{p}/status").read_text().splitlines()
            )
            own = status["Name"].strip()
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [(int(c), own) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        name = f"{own} (forking)" if own == parent else own
        resident = proportional_bytes(p) if proportional else int(status["VmRSS"].split()[0]) * 1024
        by_name[name] = (
            by_name.get(name, 0) + resident - (kv_pool_resident(p) if without_kv_pool else 0)
        )
    return by_name


def proportional_bytes(pid: int) -> int:
    """Process ``pid``'s proportional set size (PSS, /proc/PID/smaps_rollup); 0 for a process that ended."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def kv_pool_resident(pid: int) -> int:
    """Resident bytes of process ``pid``'s KV pool mappings (engine/kv_backend/paged.py ``host_zeros``: memfds
    named ``pagedchat-kv``); 0 for a process that ended."""
    total, in_pool = 0, False
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if not head.endswith(":"):
            # (a mapping's first line: "start-end perms offset dev inode [path]")
            in_pool = "/memfd:pagedchat-kv" in line
        elif in_pool and head == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


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
