"""The soak and chaos benchmark's two-minute run (benchmarks/soak.py): three tenants with a mixed workload while
Redis is killed, then frozen, a storm of clients connects and drops, and the engine core is killed (the server is
started again); every turn a client saw complete is stored, nothing fails outside the faults, KV usage is 0 at idle,
memory holds, and each tenant's TPOT p50 stays within 2x its unloaded one (its own workload run alone first).

The benchmark runs in a process of its own, as its command line does: its clients time every streamed token, and
inside the test runner they would share a process (and its garbage collector's pauses over a whole suite's heap)
with everything the suite left behind. In a full run on 2 vCPUs that put the clients' own delays into the loaded
TPOT (42 ms loaded against 20-23 ms alone, 1.9-2.1x, where the same code run alone measured 1.2-1.6x)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_two_minutes_of_soak_and_chaos_keep_every_promise():
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.online.soak", "--duration", "120"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "FAIL" not in run.stdout
    assert run.stdout.count("PASS") == 6, run.stdout[-3000:]
