"""benchmarks.offline.nano's pure helpers: the nano workload as WORKLOADS.md defines it (benchmarks.harness.workloads), and
the report."""

from __future__ import annotations

import random

import pytest

from benchmarks.harness.engine import Run
from benchmarks.offline.nano import added_us, busy_us, kernel_times, parse_args, throughput_table
from benchmarks.harness.workloads import capped, nano_workload


def test_nano_workload_follows_the_spec_draw_order():
    # WORKLOADS.md: Random(0); per request the prompt length, its ids in [0, 10000), then the output length
    rng = random.Random(0)
    expected = []
    for _ in range(5):
        prompt_len = rng.randint(100, 1024)
        prompt = [rng.randint(0, 9999) for _ in range(prompt_len)]
        expected.append((prompt, rng.randint(100, 1024)))
    assert [(r.prompt, r.output_len) for r in nano_workload(5)] == expected


def test_nano_workload_is_deterministic_and_within_the_ranges():
    requests = nano_workload(256)
    assert requests == nano_workload(256)
    assert all(100 <= len(r.prompt) <= 1024 and 100 <= r.output_len <= 1024 for r in requests)
    assert all(0 <= t < 10000 for r in requests for t in r.prompt)
    assert nano_workload(3) == requests[:3]  # a peer subset is the workload's first requests


def test_smoke_caps_clip_the_lengths():
    requests = nano_workload(4, prompt_len=capped(8), output_len=capped(4))
    assert [len(r.prompt) for r in requests] == [8] * 4
    assert [r.output_len for r in requests] == [4] * 4


def test_busy_time_counts_overlapping_kernels_once():
    assert busy_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 15 + 5
    assert busy_us([]) == 0


def test_added_time_leaves_out_what_an_earlier_kernel_covers():
    """A PDL kernel launched at 5 that waits for its predecessor (0-10) and ends at 15 adds 5, not 10; a kernel
    inside another adds nothing; the parts sum to the busy time, in the order given."""
    intervals = [(5, 15), (0, 10), (20, 25), (21, 22)]
    added = added_us(intervals)
    assert added == [5, 10, 5, 0]
    assert sum(added) == busy_us(intervals)
    assert added_us([]) == []


def test_kernel_times_by_name_elapsed_and_added():
    from types import SimpleNamespace

    def kernel(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    # two steps: a norm (0-10), a PDL matmul launched at 5 that ends at 40, again from 100
    kernels = [kernel("norm", 0, 10), kernel("matmul", 5, 40)]
    kernels += [kernel("norm", 100, 110), kernel("matmul", 105, 140)]
    elapsed, added = kernel_times(kernels, 2, by="elapsed"), kernel_times(kernels, 2, by="added")
    assert list(elapsed) == ["matmul", "norm"]
    assert elapsed == pytest.approx({"matmul": 0.035, "norm": 0.010})
    assert added == pytest.approx({"matmul": 0.030, "norm": 0.010})


def test_table_reports_the_ratio_and_a_failed_peer():
    ours = Run("pagedchat", 256, 1000, output_tokens=1000, seconds=2.0)
    peer = Run("transformers CB", 256, 1000, output_tokens=1000, seconds=8.0)
    assert "| 500 | 4.00x |" in throughput_table("llama-3.2-1b", [ours, peer])
    failed = Run("transformers CB", 256, 1000, error="ImportError: no flash attention")
    assert "failed: ImportError" in throughput_table("llama-3.2-1b", [ours, failed])


def test_defaults_are_the_workload():
    args = parse_args(["--model-config", "llama-3.2-1b"])
    assert (args.num_requests, args.seed, args.peer, args.split, args.split_batch) == (
        256,
        0,
        True,
        True,
        256,
    )
    assert args.max_prompt_len is None and args.max_output_len is None
