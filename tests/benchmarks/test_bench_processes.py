"""A served tree's memory (benchmarks/harness/processes.py): by RSS, pages a forked child shares with its parent
count in both; by PSS (``proportional``), once between them; a child still under its parent's name (forked, not
named yet) is reported apart."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.harness.processes import resident_by_name

# a parent that touches 64 MiB, forks a child that keeps them (unwritten), and both wait
_SHARING = """
import os, sys, time
buffer = bytearray(os.urandom(1 << 20) * 64)
if os.fork() == 0:
    time.sleep(60); os._exit(0)
print("ready", flush=True); time.sleep(60)
"""


@contextlib.contextmanager
def parent_and_child() -> Iterator[int]:
    """``_SHARING`` running, its child forked: the parent's pid."""
    process = subprocess.Popen([sys.executable, "-c", _SHARING], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
        deadline = time.monotonic() + 10
        while not children.read_text().split() and time.monotonic() < deadline:
            time.sleep(0.05)
        yield process.pid
    finally:
        process.kill()
        process.wait()


def test_pss_counts_the_pages_a_fork_shares_once():
    with parent_and_child() as pid:
        rss = sum(resident_by_name(pid).values()) / 2**20
        pss = sum(resident_by_name(pid, proportional=True).values()) / 2**20
    assert rss - pss > 48, (rss, pss)  # (64 MiB shared: counted twice by RSS, once by PSS)
    assert pss > 64, pss


def test_a_child_under_its_parents_name_is_reported_apart():
    """The soak's leak check leaves such a child out (benchmarks/online/soak.py ``rss_bytes``): between the grammar
    zygote's fork and the child's own name, its RSS is the zygote's pages again."""
    with parent_and_child() as pid:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        by_name = resident_by_name(pid)
    assert set(by_name) == {name, f"{name} (forking)"}
    assert by_name[f"{name} (forking)"] > 48 * 2**20  # (the 64 MiB it shares, resident in it too)
