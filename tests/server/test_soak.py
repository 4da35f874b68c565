"""The soak and chaos benchmark's two-minute run (benchmarks/soak.py): three tenants with a mixed workload while
Redis is killed, then frozen, a storm of clients connects and drops, and the engine core is killed (the server is
started again); every turn a client saw complete is stored, nothing fails outside the faults, KV usage is 0 at idle,
memory holds, and each tenant's TPOT p50 stays within 2x its unloaded one (its own workload run alone first)."""

from __future__ import annotations

from benchmarks import soak


def test_two_minutes_of_soak_and_chaos_keep_every_promise(capsys):
    status = soak.main(["--duration", "120"])
    out = capsys.readouterr().out
    assert status == 0, out[-6000:]
    assert "FAIL" not in out
