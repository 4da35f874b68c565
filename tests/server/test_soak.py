"""The soak and chaos benchmark's short run (benchmarks/online/soak.py): three tenants with a mixed workload for
25 s clear of faults, then Redis killed, Redis frozen, a storm of clients that connect and drop, and the engine
core killed (the server is started again), one every 6.25 s; every turn a client saw complete is stored, nothing
fails outside the faults, KV usage is 0 at idle, memory holds, and each tenant's TPOT p50 stays within 2x its
unloaded one (its own workload run alone first, 6 s a tenant).

The two-minute run (faults from 24 s on) checks the same promises; this schedule keeps each fault and the loaded
stretch the TPOT is read from, for half the time on a 2-vCPU CI machine that may run it twice (`make test`: natively
and, where the CPU has more than AVX2, held to AVX2).

The benchmark runs in a process of its own, as its command line does: its clients time every streamed token, and
inside the test runner they would share a process (and its garbage collector's pauses over a whole suite's heap)
with everything the suite left behind. In a full run on 2 vCPUs that put the clients' own delays into the loaded
TPOT (42 ms loaded against 20-23 ms alone, 1.9-2.1x, where the same code run alone measured 1.2-1.6x)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# alone, after the tests spread over workers: it times streams (Makefile)
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]
SOAK = ["--duration", "50", "--faults-from", "0.5", "--alone-s", "6"]
# held to AVX2 (make test's second run, after the first has soaked the same code): the same promises
# and every fault once, over a shorter run (18 s loaded clear of faults, then a fault every 6.75 s)
SOAK_HELD_TO_AVX2 = ["--duration", "45", "--faults-from", "0.4", "--alone-s", "6"]


def soak_schedule() -> list[str]:
    return SOAK_HELD_TO_AVX2 if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2" else SOAK


def test_a_short_soak_with_every_fault_keeps_every_promise():
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.online.soak", *soak_schedule()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "FAIL" not in run.stdout
    assert run.stdout.count("PASS") == 6, run.stdout[-3000:]
    for fault in ("redis_killed", "redis_frozen", "storm", "core_killed"):
        assert f"fault {fault}:" in run.stdout, run.stdout[-3000:]
