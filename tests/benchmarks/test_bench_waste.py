"""The waste benchmark's pure parts: the nano workload, each mode's reservation, and reservation admission
(a ReservingScheduler over a real BlockManager, driven the way the engine drives it, with no model)."""

from __future__ import annotations

import pytest

from benchmarks.offline.waste import ReservingScheduler, next_pow2, reservation_slots
from benchmarks.harness.workloads import nano_workload
from engine.core.block_hash import BlockHasher
from engine.core.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus

BLOCK = 16


def test_nano_workload_draws_within_bounds_and_repeats_with_the_seed():
    requests = nano_workload(256, seed=0)
    assert len(requests) == 256
    assert all(100 <= len(r.prompt) <= 1024 and 100 <= r.output_len <= 1024 for r in requests)
    assert all(0 <= t < 10_000 for r in requests for t in r.prompt)
    assert nano_workload(256, seed=0) == requests
    assert nano_workload(256, seed=1) != requests
    lengths = [len(r.prompt) for r in requests]
    assert min(lengths) < 200 and max(lengths) > 900  # spread over the range, not a constant


def test_nano_workload_draws_length_then_ids_then_output():
    import random

    rng = random.Random(7)
    prompt_len = rng.randint(5, 9)
    ids = [rng.randrange(10_000) for _ in range(prompt_len)]
    output_len = rng.randint(3, 4)
    (request,) = nano_workload(1, seed=7, prompt_len=(5, 9), output_len=(3, 4))
    assert request.prompt == ids and request.output_len == output_len


@pytest.mark.parametrize(
    "n, expected", [(1, 1), (2, 2), (3, 4), (100, 128), (512, 512), (513, 1024)]
)
def test_next_pow2(n, expected):
    assert next_pow2(n) == expected


@pytest.mark.parametrize(
    "mode, prompt, max_tokens, expected",
    [
        ("reserve-max", 100, 100, 2048),  # always max_model_len
        ("reserve-max", 1024, 1024, 2048),
        ("reserve-pow2", 100, 200, 512),  # 300 -> 512
        ("reserve-pow2", 1000, 24, 1024),  # exactly a power of two
        ("reserve-pow2", 1000, 25, 2048),
        ("reserve-oracle", 300, 400, 700),
        ("reserve-oracle", 1024, 1024, 2048),
    ],
)
def test_reservation_of_each_mode(mode, prompt, max_tokens, expected):
    assert reservation_slots(mode, prompt, max_tokens, max_model_len=2048) == expected


def test_pow2_reservation_is_capped_at_max_model_len():
    assert reservation_slots("reserve-pow2", 1000, 200, max_model_len=1500) == 1500


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode"):
        reservation_slots("paged", 10, 10, 2048)


# admission ------------------------------------------------------------------------------------------------


def block_manager(num_blocks: int) -> BlockManager:
    return BlockManager(
        num_blocks, BLOCK, enable_prefix_caching=False, hasher=BlockHasher("sha256", "test", "")
    )


def request(seq_id: int, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        token_ids=[1] * prompt_len,
        params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
    )


def step(scheduler: Scheduler) -> list[Sequence]:
    """One engine step without a model: schedule, mark the KV written, append a token where one is sampled.
    Returns the sequences in the batch."""
    batch = scheduler.schedule()
    scheduler.advance(list(zip(batch.seqs, batch.num_new_tokens)))
    for seq in batch.sampling_seqs:
        seq.append_token(2)
    return batch.seqs


def submit(scheduler: Scheduler, seqs: list[Sequence]) -> None:
    for seq in seqs:
        scheduler.add(seq)


def test_reserve_max_admits_only_what_the_pool_holds_at_max_model_len():
    # pool 8 blocks = 128 slots; each request reserves max_model_len 64 slots (4 blocks): two fit
    scheduler = ReservingScheduler(block_manager(8), 8, 4096, "reserve-max", max_model_len=64)
    seqs = [request(i, 10, 5) for i in range(3)]
    submit(scheduler, seqs)
    step(scheduler)
    assert scheduler.running == seqs[:2] and list(scheduler.waiting) == [seqs[2]]
    assert scheduler.reserved_slots == 128
    step(scheduler)
    assert list(scheduler.waiting) == [seqs[2]]  # still no room while both run


def test_waiting_request_is_admitted_once_a_running_one_finishes():
    scheduler = ReservingScheduler(block_manager(8), 8, 4096, "reserve-max", max_model_len=64)
    seqs = [request(i, 10, 5) for i in range(3)]
    submit(scheduler, seqs)
    step(scheduler)
    scheduler.finish(seqs[0], SequenceStatus.FINISHED_LENGTH)
    assert scheduler.reserved_slots == 64  # released with the sequence
    assert seqs[2] in step(scheduler)
    assert scheduler.running == [seqs[1], seqs[2]] and not scheduler.waiting
    assert scheduler.reserved_slots == 128


def test_paged_scheduler_admits_all_three_in_the_same_pool():
    scheduler = Scheduler(block_manager(8), 8, 4096)
    seqs = [request(i, 10, 5) for i in range(3)]
    submit(scheduler, seqs)
    step(scheduler)
    assert scheduler.running == seqs  # 1 block each: the reservation is what held the third back


def test_oracle_reserves_prompt_plus_output_in_whole_blocks():
    # 20 + 12 = 32 slots = 2 blocks each; 20 + 13 = 33 slots = 3 blocks: in 8 blocks, 2 + 3 + 2 fit, not a 4th
    scheduler = ReservingScheduler(block_manager(8), 8, 4096, "reserve-oracle", max_model_len=64)
    seqs = [request(0, 20, 12), request(1, 20, 13), request(2, 20, 12), request(3, 20, 12)]
    submit(scheduler, seqs)
    step(scheduler)
    assert scheduler.running == seqs[:3] and list(scheduler.waiting) == [seqs[3]]
    assert scheduler.reserved_slots == 32 + 33 + 32


def test_a_head_that_does_not_fit_blocks_smaller_requests_behind_it():
    # pow2: 40 + 20 = 60 -> 64 slots (4 blocks); a big 100 + 20 -> 128 slots (8 blocks); a small 5 + 5 -> 16
    scheduler = ReservingScheduler(block_manager(8), 8, 4096, "reserve-pow2", max_model_len=128)
    first, big, small = request(0, 40, 20), request(1, 100, 20), request(2, 5, 5)
    submit(scheduler, [first, big, small])
    step(scheduler)
    # FCFS, as the engine's
    assert scheduler.running == [first] and list(scheduler.waiting) == [big, small]


def test_blocks_taken_never_exceed_the_reservation():
    # reservations of 32, 41, 50, 59, 68 slots = 2 + 3 + 4 + 4 + 5 blocks: the last waits for a finish
    scheduler = ReservingScheduler(block_manager(16), 8, 4096, "reserve-oracle", max_model_len=128)
    seqs = [request(i, 17 + 9 * i, 15) for i in range(5)]
    submit(scheduler, seqs)
    finished = []
    for _ in range(60):  # 15 steps per request, the last one after the first finish: about 30
        if not scheduler.has_unfinished():
            break
        step(scheduler)
        for seq in scheduler.running:
            reserved_blocks = -(-scheduler.reservations[seq.seq_id] // BLOCK)
            assert len(seq.block_table) <= reserved_blocks
        assert scheduler.reserved_slots <= 16 * BLOCK
        for seq in list(scheduler.running):
            if seq.num_output_tokens >= seq.params.max_tokens:
                scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
                finished.append(seq)
    assert finished[-1] is seqs[4] and len(finished) == 5 and scheduler.num_preemptions == 0
