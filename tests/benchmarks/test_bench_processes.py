"""A served tree's memory (benchmarks/harness/processes.py): by RSS, pages a forked child shares with its parent
count in both; by PSS (``proportional``), once between them."""

from __future__ import annotations

import subprocess
import sys
import time
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


def test_pss_counts_the_pages_a_fork_shares_once():
    process = subprocess.Popen([sys.executable, "-c", _SHARING], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
        deadline = time.monotonic() + 10
        while not children.read_text().split() and time.monotonic() < deadline:
            time.sleep(0.05)
        rss = sum(resident_by_name(process.pid).values()) / 2**20
        pss = sum(resident_by_name(process.pid, proportional=True).values()) / 2**20
        assert rss - pss > 48, (rss, pss)  # (64 MiB shared: counted twice by RSS, once by PSS)
        assert pss > 64, pss
    finally:
        process.kill()
        process.wait()
