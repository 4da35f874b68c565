"""The start-up warm-up's plan (engine/worker/warm_up.py): the token and row counts it walks put a count in every
class Triton specializes an integer on (1, a multiple of 16, other) and on both sides of every power of two up to
the limit; on the CPU (nothing compiles there) and when switched off it does not run."""

from __future__ import annotations

from types import SimpleNamespace

from engine.config import EngineConfig
from engine.worker.warm_up import count_ladder, warm_up


def test_count_ladder_covers_each_class_and_both_sides_of_each_power_of_two():
    limit = 8192
    counts = count_ladder(limit)
    assert counts == sorted(set(counts)) and counts[0] == 1 and counts[-1] == limit
    for exponent in range(1, 14):
        assert {2**exponent, 2**exponent + 1} <= set(counts) | {limit + 1}
    assert any(n % 16 == 0 for n in counts) and any(n > 16 and n % 16 for n in counts)
    # the skinny matmul's row buckets (1, 2, 4, 8, 16, 32) each get a count that rounds up to them
    assert {1 << (n - 1).bit_length() for n in counts if n <= 32} == {1, 2, 4, 8, 16, 32}
    assert count_ladder(1) == [1]
    assert count_ladder(5) == [1, 2, 3, 4, 5]
    assert count_ladder(100)[-1] == 100 and 101 not in count_ladder(100)


def test_warm_up_runs_only_on_cuda_and_when_on():
    for options in ({"device": "cpu"}, {"device": "cpu", "warm_up": False}):
        runner = SimpleNamespace(config=EngineConfig(**options))  # (nothing of it may be touched)
        assert warm_up(runner, 16) == 0.0
