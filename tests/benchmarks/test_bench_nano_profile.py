"""The whole-run profile's counting (benchmarks.offline.nano_profile) and the mixed-context decode benchmark's rows
(benchmarks.kernel.decode_attention_mixed): what they count from the nano workload, checked by brute force. The
timed parts need a GPU (they run on the device)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from benchmarks.harness.workloads import nano_workload
from benchmarks.kernel.decode_attention_mixed import nano_contexts
from benchmarks.offline.nano_profile import (
    MARKER,
    attended_kv_tokens,
    idle_by_group,
    part_of,
    run_workload,
)


def test_attended_tokens_are_every_decode_steps_context():
    """A request of prompt p and n outputs: its first token comes from the prefill, then n - 1 decode steps at
    contexts p + 1 .. p + n - 1 (the new token's own position included)."""
    args = argparse.Namespace(num_requests=7, seed=3)
    brute = sum(len(r.prompt) + t for r in nano_workload(7, 3) for t in range(1, r.output_len))
    assert attended_kv_tokens(args) == brute
    assert attended_kv_tokens(argparse.Namespace(num_requests=7, seed=4)) != brute


def test_kernels_are_split_into_parts_by_name():
    assert part_of("_decode_kernel") == "decode attention"
    assert part_of("_persistent_decode_kernel") == "persistent decode"
    assert part_of("_prefill_kernel") == "prefill attention"
    assert part_of("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "matrix products"
    assert part_of("_skinny_kernel") == "matrix products"
    assert (
        part_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matrix products"
    )
    for name in ("_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel", "_argmax_kernel"):
        assert part_of(name) == "the rest"


class FakeEngine:
    """Steps a scripted list of batches (each a list of new-token counts per sequence), as ``engine.last_batch``."""

    def __init__(self, batches: list[list[int] | None]) -> None:
        self.batches = list(batches)
        self.added: list[str] = []
        self.counters = SimpleNamespace(steps=0)
        self.last_batch = None

    def add_request(self, rid, prompt, params) -> None:
        self.added.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.batches)

    def step(self, finals_only: bool = False) -> list:
        assert finals_only  # (as the nano benchmark drives the engine)
        news = self.batches.pop(0)
        if news is not None:  # (None: a step that scheduled nothing)
            self.counters.steps += 1
            self.last_batch = SimpleNamespace(num_new_tokens=news)
        return []


def test_run_counts_prompt_tokens_and_decode_rows_per_step():
    engine = FakeEngine([[300, 200], [1, 1, 500], None, [1, 1, 1], [1]])
    args = argparse.Namespace(num_requests=3, seed=0)
    shapes = run_workload(engine, args, "x", seed=0)
    assert engine.added == ["x-0", "x-1", "x-2"]
    assert shapes.prompt_tokens == 1000
    assert shapes.decode_rows == [0, 2, 3, 1]  # the empty step is not a step
    assert shapes.prompts_finished == 3
    assert shapes.groups == [
        "with prompt tokens",
        "with prompt tokens",
        None,
        "decode <= 16 rows",
        "decode <= 16 rows",
    ]
    assert len(shapes.walls) == 5 and min(shapes.walls) >= 0 and shapes.add_seconds > 0


def test_idle_is_charged_to_the_step_whose_kernel_ends_it():
    """Markers open steps; a gap between kernels goes to the group of the step that ends it, overlapping kernels
    add only what sticks out, and a step that launched nothing leaves its kernels with the group before."""
    kernels = [
        (MARKER, 0.0, 1.0),
        ("a", 2.0, 10.0),  # step 0 (prefill): busy 8, no gap before the first kernel
        ("b", 12.0, 20.0),  # gap 2
        ("b2", 15.0, 25.0),  # overlaps b: adds 5
        (MARKER, 30.0, 31.0),
        ("c", 40.0, 44.0),  # step 1 (decode): gap 15 (the marker's microsecond counts as idle)
        (MARKER, 45.0, 46.0),  # step 2 launched no pass: still step 1's group
        ("d", 50.0, 51.0),  # gap 6
    ]
    groups = ["with prompt tokens", "decode <= 16 rows", None]
    table = idle_by_group(kernels, groups)
    prefill = table["with prompt tokens"]
    assert (prefill["busy_s"], prefill["idle_s"], prefill["idle_at_start_s"]) == (21e-6, 2e-6, 0.0)
    assert prefill["idle_before"] == {"b": 2e-6}
    row = table["decode <= 16 rows"]
    assert abs(row["busy_s"] - 5e-6) < 1e-12 and abs(row["idle_s"] - 21e-6) < 1e-12
    assert abs(row["idle_at_start_s"] - 15e-6) < 1e-12  # d follows a step that launched nothing
    assert list(row["idle_before"]) == ["c", "d"]  # most first
    busy = sum(r["busy_s"] for r in table.values())
    idle = sum(r["idle_s"] for r in table.values())
    assert (
        abs(busy + idle - (51.0 - 2.0) * 1e-6) < 1e-12
    )  # first kernel to last: every microsecond once


def test_mixed_contexts_are_the_running_rows_in_order():
    requests = nano_workload(256)
    for step in (0, 300, 900):
        expected = [len(r.prompt) + step for r in requests if r.output_len > step]
        assert nano_contexts(step) == expected
    assert len(nano_contexts(0)) == 256  # every output is >= 100 tokens
    assert len(nano_contexts(900)) < len(nano_contexts(300)) < 256
