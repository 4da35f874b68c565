"""Admission of requests that share a prefix another running request is still computing: they wait for the
prefix to be cached instead of computing it a second time in the same burst."""

from __future__ import annotations

from engine.core.block_hash import BlockHasher
from engine.core.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.sequence import Sequence
from tests.block_invariants import check_pool

BLOCK = 4
PREFIX = list(range(100, 112))  # three full blocks shared by every request below


def make_scheduler(caching: bool = True, num_blocks: int = 64, budget: int = 64) -> Scheduler:
    manager = BlockManager(
        num_blocks, BLOCK, enable_prefix_caching=caching, hasher=BlockHasher("sha256", "t", "")
    )
    return Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=budget)


def request(seq_id: int, suffix: list[int], salt: str | None = None) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        token_ids=PREFIX + suffix,
        cache_salt=salt,
        params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    )


def step(scheduler: Scheduler) -> dict[str, int]:
    """One step without a model; the scheduled tokens per request id."""
    batch = scheduler.schedule()
    scheduler.advance(list(zip(batch.seqs, batch.num_new_tokens)))
    for seq in batch.sampling_seqs:
        seq.append_token(7)
    return {seq.request_id: n for seq, n in zip(batch.seqs, batch.num_new_tokens)}


def assert_accounting(scheduler: Scheduler) -> None:
    check_pool(scheduler.block_manager, list(scheduler.running) + list(scheduler.waiting))
    assert all(not seq.block_table for seq in scheduler.waiting)


def test_a_burst_sharing_a_prefix_computes_it_once():
    scheduler = make_scheduler()
    a, b, c = request(0, [1, 2, 3]), request(1, [4, 5, 6]), request(2, [8, 9])
    for seq in (a, b, c):
        scheduler.add(seq)
    first = step(scheduler)
    assert first == {"r0": 15}, "b and c wait while a computes the shared blocks"
    assert [s.request_id for s in scheduler.waiting] == ["r1", "r2"], "they keep their places"
    assert_accounting(scheduler)
    second = step(scheduler)
    assert second == {"r0": 1, "r1": 3, "r2": 2}, "only their own suffixes are computed"
    assert b.num_cached_tokens == c.num_cached_tokens == len(PREFIX)
    assert b.block_table[:3] == c.block_table[:3] == a.block_table[:3]
    assert_accounting(scheduler)


def test_without_prefix_caching_nothing_waits():
    scheduler = make_scheduler(caching=False)
    for seq in (request(0, [1, 2, 3]), request(1, [4, 5, 6])):
        scheduler.add(seq)
    assert step(scheduler) == {"r0": 15, "r1": 15}


def test_another_salt_does_not_wait_and_does_not_share():
    scheduler = make_scheduler()
    a, b = request(0, [1, 2, 3], salt="tenant-a"), request(1, [1, 2, 3], salt="tenant-b")
    scheduler.add(a)
    scheduler.add(b)
    assert step(scheduler) == {"r0": 15, "r1": 15}
    assert not set(a.block_table) & set(b.block_table)


def test_a_chunked_owner_holds_back_until_its_blocks_are_cached():
    scheduler = make_scheduler(budget=6)  # the owner's 15 prompt tokens take three steps
    a, b = request(0, [1, 2, 3]), request(1, [4, 5, 6])
    scheduler.add(a)
    scheduler.add(b)
    assert step(scheduler) == {"r0": 6}
    assert step(scheduler) == {"r0": 6}  # a still computes block 3 of the prefix: b waits
    third = step(scheduler)
    assert third["r0"] == 3 and third["r1"] == 3, (
        "b starts after the shared blocks, with the budget left"
    )
    assert b.num_cached_tokens == len(PREFIX)


def test_a_preempted_owner_no_longer_holds_others_back():
    scheduler = make_scheduler(budget=6)
    a, b = request(0, [1, 2, 3]), request(1, [4, 5, 6])
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    scheduler.preempt(a)  # as under memory pressure: a goes back to the head of the queue
    assert [s.request_id for s in scheduler.waiting] == ["r0", "r1"]
    batch = step(scheduler)
    assert "r0" in batch and "r1" not in batch, (
        "a is admitted again (its first block hit) and b waits for it"
    )
    assert a.num_cached_tokens >= 0
    assert_accounting(scheduler)


def test_requests_behind_a_deferred_one_are_still_admitted_in_order():
    scheduler = make_scheduler()
    a, b = request(0, [1, 2, 3]), request(1, [4, 5, 6])
    other = Sequence(
        seq_id=2,
        request_id="r2",
        token_ids=[50, 51, 52, 53, 54],
        params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    )
    for seq in (a, b, other):
        scheduler.add(seq)
    assert step(scheduler) == {"r0": 15, "r2": 5}
    assert [s.request_id for s in scheduler.waiting] == ["r1"]
