"""The resident memory of a served process tree (the front, the engine core, the grammar workers), read from
/proc."""

from __future__ import annotations

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
