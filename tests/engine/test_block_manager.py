"""Block manager specification: the documented hash chain, prefix hits, eviction order, all-or-nothing
allocation, copy-on-write, stats — and a state machine that drives the manager as the engine does while a
model of the KV cache checks that no sequence ever reads another's tokens.

Expected hashes come from tests/block_invariants.py (hashlib/xxhash by hand, following the documented
chain); expected block ids and counts are worked out by hand from the pool's rules.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pytest
import xxhash
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from block_invariants import (
    ReferenceHashes,
    check_contents,
    check_host,
    check_pool,
    kv_tokens,
    reference_block_hash,
    reference_chain,
    reference_root,
    snapshot,
    with_pending,
)
from engine.core.block_hash import BlockHasher
from engine.core.block_manager import BlockManager
from engine.core.host_prefix_cache import HostHit
from engine.core.block_pool import Block
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4
MODEL = "test/model"
SEED = "s3cret"


# ---------------------------------------------------------------- helpers


def make_bm(
    num_blocks: int,
    algo: str = "sha256",
    caching: bool = True,
    num_host_blocks: int = 0,
    num_host_cache_blocks: int = 0,
) -> BlockManager:
    return BlockManager(
        num_blocks,
        BS,
        caching,
        BlockHasher(algo, MODEL, SEED),
        num_host_blocks,
        num_host_cache_blocks,
    )


def make_seq(seq_id: int, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        token_ids=list(tokens),
        params=SamplingParams(),
        cache_salt=salt,
    )


def admit(bm: BlockManager, seq: Sequence, num_new: int | None = None) -> list[int]:
    """Admission as the scheduler does it; returns the hit block ids."""
    hits = bm.match_prefix(seq)
    if num_new is None:
        num_new = seq.num_tokens - len(hits) * BS
    assert bm.allocate(seq, num_new, hits)
    return [b.block_id for b in hits]


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """The forward pass wrote KV for ``n`` more tokens."""
    seq.num_computed_tokens += n
    bm.commit(seq)


def run_prompt(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit and prefill the whole prompt in one step; returns the hit block ids."""
    hits = admit(bm, seq)
    compute(bm, seq, seq.num_uncomputed_tokens)
    return hits


def hit_count(
    bm: BlockManager, tokens: list[int], salt: str | None = None, seq_id: int = 999
) -> int:
    return len(bm.match_prefix(make_seq(seq_id, tokens, salt)))


# ---------------------------------------------------------------- hashing


@pytest.mark.parametrize("algo", ["sha256", "xxh128"])
def test_hash_chain_matches_documented_formula(algo: str) -> None:
    hasher = BlockHasher(algo, MODEL, SEED)
    by_hand = {"sha256": hashlib.sha256, "xxh128": xxhash.xxh3_128}[algo]
    root = by_hand(
        b"\x17\0\0\0\0\0\0\0pagedchat-block-root-v1"
        b"\x0a\0\0\0\0\0\0\0test/model"
        b"\x06\0\0\0\0\0\0\0s3cret"
    ).digest()
    assert hasher.root == root

    tokens = [7, 300, 2**40, 0, 5, 6, 7, 8, 9]  # two full blocks; the 9th token is in none
    block0 = by_hand(
        root + b"".join(t.to_bytes(8, "little") for t in tokens[:4]) + b"(('salt', 'tenant-a'),)"
    ).digest()
    block1 = by_hand(block0 + b"".join(t.to_bytes(8, "little") for t in tokens[4:8])).digest()
    bm = BlockManager(16, BS, True, hasher)
    seq = make_seq(0, tokens, salt="tenant-a")
    bm.update_block_hashes(seq)
    assert seq.block_hashes == [block0, block1]
    assert len(block0) == {"sha256": 32, "xxh128": 16}[algo]
    assert seq.block_hashes == reference_chain(algo, root, tokens, "tenant-a", BS)

    unsalted = make_seq(1, tokens)
    bm.update_block_hashes(unsalted)
    assert unsalted.block_hashes[0] == reference_block_hash(algo, root, tokens[:4])
    # the salt is block 0's extra key only; block 1 is chained to block 0 with no extra key
    assert unsalted.block_hashes[1] == reference_block_hash(
        algo, unsalted.block_hashes[0], tokens[4:8]
    )
    # tagged: a salt never hashes like the same text given as an untagged key
    assert (
        block0
        != by_hand(
            root + b"".join(t.to_bytes(8, "little") for t in tokens[:4]) + b"tenant-a"
        ).digest()
    )


@pytest.mark.parametrize("algo", ["sha256", "xxh128"])
@pytest.mark.parametrize("other", [("other/model", SEED), (MODEL, "another-seed")])
def test_different_model_or_seed_changes_every_hash(algo: str, other: tuple[str, str]) -> None:
    tokens = list(range(12))
    mine = reference_chain(algo, reference_root(algo, MODEL, SEED), tokens, None, BS)
    seq = make_seq(0, tokens)
    BlockManager(4, BS, True, BlockHasher(algo, *other)).update_block_hashes(seq)
    assert seq.block_hashes == reference_chain(algo, reference_root(algo, *other), tokens, None, BS)
    assert len(seq.block_hashes) == 3 and not set(seq.block_hashes) & set(mine)


def test_same_model_and_seed_give_the_same_hashes_across_instances() -> None:
    a, b = make_seq(0, list(range(8))), make_seq(1, list(range(8)))
    make_bm(4).update_block_hashes(a)
    make_bm(4).update_block_hashes(b)
    assert a.block_hashes == b.block_hashes


# ---------------------------------------------------------------- prefix hits


def test_hit_is_capped_to_leave_one_token() -> None:
    bm = make_bm(8)
    first = make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8])
    run_prompt(bm, first)
    # 8 tokens = 2 full blocks: the second would leave nothing to compute, so only block 0 hits
    again = make_seq(1, [1, 2, 3, 4, 5, 6, 7, 8])
    assert admit(bm, again) == [first.block_table[0]]
    assert again.num_computed_tokens == 4 and again.num_uncomputed_tokens == 4
    # one more token: both blocks hit, one token is left
    assert hit_count(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 2
    assert hit_count(bm, [1, 2, 3, 4]) == 0


def test_prefix_hit_stops_at_first_miss() -> None:
    bm = make_bm(8)
    run_prompt(bm, make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert hit_count(bm, [1, 2, 3, 4, 0, 6, 7, 8, 9]) == 1
    # block 1 alone never hits: it is chained
    assert hit_count(bm, [0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0


def test_cache_salt_isolates_prefixes() -> None:
    bm = make_bm(16)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    run_prompt(bm, make_seq(0, tokens, salt="tenant-a"))
    assert hit_count(bm, tokens, salt="tenant-b") == 0
    assert hit_count(bm, tokens, salt=None) == 0
    assert hit_count(bm, tokens, salt="tenant-a") == 2
    run_prompt(bm, make_seq(1, tokens))
    assert hit_count(bm, tokens, salt=None) == 2
    assert hit_count(bm, tokens, salt="") == 0  # the empty salt is a salt, not "no salt"


def test_generated_tokens_become_hittable_after_commit() -> None:
    bm = make_bm(8)
    seq = make_seq(0, [1, 2, 3])
    run_prompt(bm, seq)
    seq.append_token(4)  # sampled: its KV is not written yet
    assert hit_count(bm, [1, 2, 3, 4, 5]) == 0
    assert bm.allocate(seq, 1)
    assert hit_count(bm, [1, 2, 3, 4, 5]) == 0  # allocated, still not written
    compute(bm, seq, 1)
    assert [b.block_id for b in bm.match_prefix(make_seq(1, [1, 2, 3, 4, 5]))] == [
        seq.block_table[0]
    ]
    root = reference_root("sha256", MODEL, SEED)
    assert bm.pool.blocks[seq.block_table[0]].block_hash == reference_block_hash(
        "sha256", root, [1, 2, 3, 4]
    )


def test_freed_blocks_stay_hittable_until_reused() -> None:
    bm = make_bm(4)
    first = make_seq(0, list(range(12)))
    run_prompt(bm, first)
    blocks = list(first.block_table)
    bm.free(first)
    assert bm.num_free_blocks == 4
    again = make_seq(1, list(range(12)) + [99])
    assert admit(bm, again) == blocks
    bm.free(again)
    other = make_seq(2, list(range(100, 116)))  # needs all 4 blocks: every cached one is reused
    run_prompt(bm, other)
    assert hit_count(bm, list(range(12)) + [99]) == 0


def test_tail_blocks_evicted_before_head_blocks() -> None:
    bm = make_bm(3)
    first = make_seq(0, list(range(12)))  # 3 full blocks, all cached
    run_prompt(bm, first)
    head, middle, tail = first.block_table
    bm.free(first)
    fresh = make_seq(1, [50])
    admit(bm, fresh)
    assert fresh.block_table == [tail]
    assert bm.stats().evictions == 1
    assert [b.block_id for b in bm.match_prefix(make_seq(2, list(range(12)) + [99]))] == [
        head,
        middle,
    ]
    bm.free(fresh)  # the now unhashed block goes first, then the least recently freed cached one
    two = make_seq(3, list(range(60, 65)))
    admit(bm, two)
    assert two.block_table == [tail, middle] and bm.stats().evictions == 2
    assert hit_count(bm, list(range(12)) + [99]) == 1


def test_unhashed_blocks_are_reused_before_cached_ones() -> None:
    bm = make_bm(2)
    first = make_seq(0, [1, 2, 3, 4, 5, 6])  # block 0 full (cached), block 1 partial (no hash)
    run_prompt(bm, first)
    full, partial = first.block_table
    bm.free(first)
    fresh = make_seq(1, [9])
    admit(bm, fresh)
    assert fresh.block_table == [partial]
    assert hit_count(bm, [1, 2, 3, 4, 5]) == 1 and bm.stats().evictions == 0

    bm = make_bm(4)  # two never-used blocks and one unhashed block go before the cached one
    first = make_seq(0, [1, 2, 3, 4, 5, 6])
    run_prompt(bm, first)
    full, partial = first.block_table
    bm.free(first)
    big = make_seq(1, list(range(20, 32)))
    admit(bm, big)
    assert full not in big.block_table and partial in big.block_table
    assert hit_count(bm, [1, 2, 3, 4, 5]) == 1 and bm.stats().evictions == 0


def test_reset_prefix_cache_forgets_free_blocks_only() -> None:
    bm = make_bm(8)
    kept = make_seq(0, list(range(9)))
    run_prompt(bm, kept)
    gone = make_seq(1, list(range(50, 59)))
    run_prompt(bm, gone)
    bm.free(gone)
    assert bm.reset_prefix_cache() == 2
    assert hit_count(bm, list(range(50, 59))) == 0
    assert hit_count(bm, list(range(9))) == 2
    assert bm.stats().num_cached_blocks == 2 and bm.stats().evictions == 0


def test_prefix_caching_off_never_hits() -> None:
    bm = make_bm(8, caching=False)
    run_prompt(bm, make_seq(0, list(range(9))))
    assert hit_count(bm, list(range(9))) == 0 and bm.stats().num_cached_blocks == 0


def test_pinned_blocks_survive_eviction_pressure_until_unpinned() -> None:
    bm = make_bm(4)
    preset = make_seq(0, list(range(9)))  # two full blocks (cached) and one partial
    run_prompt(bm, preset)
    head, second, _ = preset.block_table
    bm.free(preset)
    chain = reference_chain(
        "sha256", reference_root("sha256", MODEL, SEED), list(range(9)), None, BS
    )
    assert bm.pin("preset:a", chain, max_pinned_blocks=2) == 2
    check_pool(bm, [])
    assert bm.num_free_blocks == 2 and bm.stats().num_pinned_blocks == 2
    assert bm.stats().usage == 0.0  # pins alone are not requests' usage
    # takes both free blocks; the pinned ones are untouchable
    other = make_seq(1, list(range(100, 108)))
    run_prompt(bm, other)
    assert set(other.block_table).isdisjoint({head, second})
    assert not bm.allocate(make_seq(2, [7]), 1)  # nothing left to evict
    assert hit_count(bm, list(range(9))) == 2
    session = make_seq(3, list(range(8)) + [42])  # a hit shares the pinned blocks
    bm.free(other)
    assert admit(bm, session) == [head, second]
    check_pool(bm, [session])
    bm.free(session)
    bm.unpin("preset:a")
    check_pool(bm, [])
    # unpinned: cached, evictable
    assert bm.num_free_blocks == 4 and hit_count(bm, list(range(9))) == 2


def test_pins_are_capped_and_stop_at_the_first_uncached_block() -> None:
    bm = make_bm(8)
    running = make_seq(0, list(range(12)))
    run_prompt(bm, running)
    chain = reference_chain(
        "sha256", reference_root("sha256", MODEL, SEED), list(range(16)), None, BS
    )
    assert bm.pin("a", chain, max_pinned_blocks=2) == 0  # 3 cached blocks would exceed the cap of 2
    assert bm.pin("a", chain, max_pinned_blocks=3) == 3  # the 4th block was never computed
    assert bm.pin("b", chain[:1], max_pinned_blocks=3) == 0  # the cap counts every pin
    assert bm.pin("a", chain[:1], max_pinned_blocks=3) == 1  # re-pinning replaces a pin
    check_pool(bm, [running])
    # the sequence's reference and the pin's
    assert bm.pool.blocks[running.block_table[0]].ref_count == 2


# ---------------------------------------------------------------- allocation


def test_allocate_is_all_or_nothing() -> None:
    bm = make_bm(3)
    holder = make_seq(0, [1, 2, 3, 4, 5])  # 2 blocks
    admit(bm, holder)
    big = make_seq(1, list(range(20, 28)))  # 2 blocks, 1 free
    before = snapshot(bm, [holder, big])
    assert not bm.allocate(big, 8, bm.match_prefix(big))
    assert (
        snapshot(bm, [holder, big]) == before
        and big.block_table == []
        and big.num_computed_tokens == 0
    )

    bm = make_bm(3)  # a hit sitting in the free queue counts against the free blocks too
    run_prompt(bm, make_seq(0, [1, 2, 3, 4, 5]))
    bm.free(bm.holders[0])
    holder = make_seq(1, [9])
    admit(bm, holder)
    reader = make_seq(2, [1, 2, 3, 4] + list(range(30, 38)))  # 1 hit (revived) + 2 fresh > 2 free
    hits = bm.match_prefix(reader)
    assert len(hits) == 1 and hits[0].ref_count == 0
    before = snapshot(bm, [holder, reader])
    assert not bm.allocate(reader, 8, hits)
    assert snapshot(bm, [holder, reader]) == before
    assert bm.allocate(reader, 4, hits)  # 1 revived + 1 fresh fit
    assert reader.num_computed_tokens == 4 and len(reader.block_table) == 2

    bm = make_bm(2)  # a copy-on-write copy needs a free block as well
    parent = make_seq(0, [1, 2])
    run_prompt(bm, parent)
    parent.append_token(3)
    child = make_seq(1, parent.token_ids)
    bm.fork(parent, child)
    parent.append_token(4)
    parent.append_token(5)
    before = snapshot(bm, [parent, child])
    assert not bm.allocate(parent, 3)  # writes block 0 (shared: copy) and block 1: 2 blocks, 1 free
    assert snapshot(bm, [parent, child]) == before
    assert bm.allocate(parent, 2)


def test_allocation_grows_table_to_exactly_the_needed_blocks() -> None:
    bm = make_bm(8)
    seq = make_seq(0, list(range(11)))
    assert bm.allocate(seq, 5, bm.match_prefix(seq))
    assert len(seq.block_table) == 2  # ceil(5 / 4)
    compute(bm, seq, 5)
    assert bm.allocate(seq, 3)
    assert len(seq.block_table) == 2  # tokens 5..7 fit in block 1
    compute(bm, seq, 3)
    assert bm.allocate(seq, 3)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5


def test_lookahead_takes_the_next_block_early_only_from_spare_blocks() -> None:
    """vattention: a sequence within ``lookahead_tokens`` of its table's end gets its next block one step
    early, while more than an eighth of the pool is free; never past ``max_blocks_per_seq``."""
    bm = BlockManager(
        16, BS, True, BlockHasher("sha256", MODEL, SEED), lookahead_tokens=2, max_blocks_per_seq=3
    )
    seq = make_seq(0, list(range(5)))
    assert bm.allocate(seq, 5, bm.match_prefix(seq))
    assert len(seq.block_table) == 2  # tokens 0..4 need 2 blocks of 4; 5 + 2 more still fit in 2
    lengths = []
    for token in range(5, 12):  # up to 12 tokens: 3 blocks, the cap
        compute(bm, seq, 1 if token > 5 else 5)
        seq.append_token(token)
        assert bm.allocate(seq, 1)
        lengths.append(len(seq.block_table))
    # with token t written (t + 1 tokens), block 3 comes once t + 1 + 2 > 8, i.e. from token 6 on, two
    # tokens before token 8 needs it; a fourth would come at token 10, but 3 is the cap
    assert lengths == [2, 3, 3, 3, 3, 3, 3]
    check_pool(bm, [seq])
    other = make_seq(1, list(range(100, 104)))
    tight = BlockManager(8, BS, True, BlockHasher("sha256", MODEL, SEED), lookahead_tokens=4)
    assert tight.allocate(other, 4, tight.match_prefix(other))
    assert len(other.block_table) == 2  # 7 of 8 free > 8 // 8 spare: one block ahead
    hog = make_seq(2, list(range(200, 220)))
    assert tight.allocate(hog, 20, tight.match_prefix(hog))
    # 1 block left free, not more than the spare: nothing taken early
    assert len(hog.block_table) == 5
    third = make_seq(3, list(range(300, 302)))
    assert tight.allocate(third, 2, tight.match_prefix(third))
    assert len(third.block_table) == 1 and tight.num_free_blocks == 0
    check_pool(tight, [other, hog, third])


def test_copy_on_write_on_first_write_into_shared_block() -> None:
    bm = make_bm(8)
    parent = make_seq(0, [1, 2, 3, 4, 5, 6])
    run_prompt(bm, parent)
    parent.append_token(7)
    full, partial = parent.block_table
    child = make_seq(1, parent.token_ids)
    bm.fork(parent, child)
    assert child.block_table == [full, partial] and child.num_computed_tokens == 6
    assert bm.pool.blocks[full].ref_count == bm.pool.blocks[partial].ref_count == 2
    assert bm.take_pending_copies() == []

    # token 6 goes into the shared partial block: parent gets its own copy
    assert bm.allocate(parent, 1)
    (copy,) = bm.take_pending_copies()
    own = parent.block_table[1]
    assert copy == (partial, own) and own not in (full, partial)
    assert parent.block_table[0] == full and child.block_table == [full, partial]
    assert bm.pool.blocks[partial].ref_count == 1 and bm.pool.blocks[own].ref_count == 1
    assert bm.pool.blocks[full].ref_count == 2  # a full block is never written again: stays shared

    assert bm.allocate(child, 1)  # the child is now the only holder: writes in place
    assert bm.take_pending_copies() == [] and child.block_table == [full, partial]
    compute(bm, parent, 1)
    compute(bm, child, 1)
    parent.append_token(8)
    assert bm.allocate(parent, 1)
    assert bm.take_pending_copies() == []  # the second write into its own block copies nothing


def test_copies_of_a_sequence_freed_before_the_pass_are_dropped() -> None:
    """The scheduler may preempt a victim after its allocation in the same step. Its copy into a block it
    no longer holds must not reach the pass: that block may be the destination of another copy of the same
    batch, and copy_blocks (one indexed assignment) leaves the winner of duplicate destinations undefined."""
    bm = make_bm(6)
    pairs = []
    for seq_id, prompt in [(0, [1, 2]), (2, [7, 8])]:
        parent = make_seq(seq_id, prompt)
        run_prompt(bm, parent)
        parent.append_token(3)
        child = make_seq(seq_id + 1, parent.token_ids)
        bm.fork(parent, child)
        pairs.append((parent, child))
    (p, _), (q, _) = pairs
    shared_q = q.block_table[0]
    assert bm.allocate(p, 1)  # copy-on-write: shared_p -> a fresh block
    bm.free(p)  # preempted as the victim; its fresh block returns to the free queue
    assert bm.allocate(q, 1)  # copy-on-write: shared_q -> the first free block, p's former copy
    assert bm.take_pending_copies() == [(shared_q, q.block_table[0])]


def test_free_releases_every_block_of_a_forked_pair_once() -> None:
    bm = make_bm(4)
    parent = make_seq(0, [1, 2, 3, 4, 5])
    run_prompt(bm, parent)
    child = make_seq(1, parent.token_ids)
    bm.fork(parent, child)
    bm.free(parent)
    assert bm.num_free_blocks == 2 and child.block_table and bm.holders == {1: child}
    bm.free(child)
    assert bm.num_free_blocks == 4 and bm.holders == {}


# ---------------------------------------------------------------- stats


def test_stats_count_prefix_queries_hits_evictions_and_used_slots() -> None:
    bm = make_bm(8)
    a = make_seq(0, list(range(10)))
    run_prompt(bm, a)  # 10 tokens: blocks 4+4+2, two cached
    s = bm.stats()
    assert (s.prefix_queries, s.prefix_hits, s.num_cached_blocks) == (10, 0, 2)
    assert (s.num_free_blocks, s.usage, s.allocated_slots, s.used_slots) == (5, 3 / 8, 12, 10)

    b = make_seq(1, list(range(8)) + [50, 51])
    assert len(admit(bm, b, num_new=1)) == 2  # hits 8 tokens, allocates a block for token 8
    s = bm.stats()
    assert (s.prefix_queries, s.prefix_hits) == (20, 8)
    # shared blocks count once; b's new block is empty
    assert (s.allocated_slots, s.used_slots) == (16, 10)
    compute(bm, b, 1)
    assert bm.stats().used_slots == 11

    bm.free(a)
    bm.free(b)
    s = bm.stats()
    assert (s.num_free_blocks, s.usage, s.allocated_slots, s.used_slots, s.evictions) == (
        8,
        0.0,
        0,
        0,
        0,
    )
    # needs all 8 blocks: both cached ones are evicted
    everything = make_seq(2, list(range(100, 132)))
    assert not bm.match_prefix(everything)
    admit(bm, everything)
    s = bm.stats()
    assert (s.evictions, s.num_cached_blocks, s.prefix_queries, s.prefix_hits) == (2, 0, 52, 8)

    failed = make_seq(3, [1])
    assert not bm.allocate(failed, 1, bm.match_prefix(failed))
    assert bm.stats().prefix_queries == 52  # a failed admission is not counted


# ---------------------------------------------------------------- host tier and swapping (regressions)


def test_host_hit_survives_the_store_its_own_restore_triggers() -> None:
    """The fresh block a host hit is copied into may evict a cached block whose store reclaims the least
    recently used host slot: it must not be the slot of the hit being restored."""
    bm = make_bm(2, num_host_cache_blocks=1)
    a = make_seq(0, [1, 2, 3, 4, 5])
    run_prompt(bm, a)
    cached = a.block_table[0]
    bm.free(a)  # [1, 2, 3, 4] cached on the device
    bm.take_pending_swaps()
    b = make_seq(1, list(range(10, 18)))
    run_prompt(bm, b)  # evicts [1, 2, 3, 4]: stored in the host tier's only slot
    assert bm.take_pending_swaps() == ([(cached, 0)], [])
    bm.free(b)  # both of b's full blocks cached, free
    c = make_seq(2, [1, 2, 3, 4, 9])
    (hit,) = bm.match_prefix(c)
    assert isinstance(hit, HostHit)
    # the restore's fresh block evicts one of b's: its store needs a slot
    assert bm.allocate(c, 1, [hit])
    outs, ins = bm.take_pending_swaps()
    assert ins == [(hit.slot, c.block_table[0])]
    assert all(slot != hit.slot for _, slot in outs), (
        "the restored slot was overwritten in the same step"
    )


def test_swap_out_in_the_step_of_its_swap_in_keeps_the_kv() -> None:
    """The scheduler swaps a sequence in, fails to allocate its next tokens and preempts it (itself the last
    running) in the same step: its new host copy must hold its KV, not the blocks' contents before the
    swap-in (the step's swap-outs run before its swap-ins)."""
    bm = make_bm(4, num_host_blocks=4)
    seq = make_seq(0, [1, 2, 3, 4, 5])
    run_prompt(bm, seq)
    kv = {0: [1, 2, 3, 4], 1: [5, None, None, None], 2: [None] * BS, 3: [None] * BS}
    assert seq.block_table == [0, 1]
    host: dict = {i: [None] * BS for i in range(4)}
    bm.swap_out(seq)
    kv, host = with_pending(kv, host, *bm.take_pending_swaps()[:1], [], [])
    bm.swap_in(seq)  # step 2: back in ...
    bm.swap_out(seq)  # ... and out again before the pass
    outs, ins = bm.take_pending_swaps()
    kv, host = with_pending(kv, host, outs, [], ins)
    read = [host[seq.host_blocks[i // BS]][i % BS] for i in range(seq.num_computed_tokens)]
    assert read == [1, 2, 3, 4, 5]


# ---------------------------------------------------------------- the engine's use, at random

TOKENS = st.integers(0, 2)  # a small alphabet: prompts share prefixes, so hits happen
PREFIXES = [(), (1, 2, 0, 1), (1, 2, 0, 1, 2, 2, 0, 0), (1, 2, 0, 1, 0, 0, 1, 1), (2, 2, 2, 2)]
PROMPTS = st.tuples(st.sampled_from(PREFIXES), st.lists(TOKENS, max_size=8)).map(
    lambda p: list(p[0]) + p[1] or [0]
)
SALTS = st.sampled_from([None, None, "a", "b"])
MAX_SEQS = 8
MAX_TOKENS = 20
PICK = st.integers(0, 2**16)
CHOICES = st.lists(st.tuples(PICK, PICK), max_size=3)  # (which sequence, how many tokens) per entry


@dataclass(frozen=True)
class Step:
    """One engine step: maybe the longest-swapped sequence back in (``resume``), running sequences scheduled,
    then waiting ones admitted; maybe a victim preempted after its allocation (swapped out when ``swap`` and the
    scheduler could, else dropped for a recompute); then the forward pass (``sampled``: next token of each
    sequence that completes)."""

    resume: bool
    running: list[tuple[int, int]]
    waiting: list[tuple[int, int]]
    preempt: int | None
    swap: bool
    sampled: list[int]


STEPS = st.builds(
    Step,
    resume=st.booleans(),
    running=CHOICES,
    waiting=CHOICES,
    # a victim in about 1 step of 4
    preempt=st.one_of(st.none(), st.none(), st.none(), PICK),
    swap=st.booleans(),
    sampled=st.lists(TOKENS, min_size=MAX_SEQS, max_size=MAX_SEQS),
)


def hit_key(hit: Block | HostHit) -> int | tuple[bytes, int]:
    return hit.block_id if isinstance(hit, Block) else (hit.block_hash, hit.slot)


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives the manager as the engine does: each ``engine_step`` schedules (running sequences first, then
    admissions), may preempt a scheduled sequence (dropping or swapping it out), then runs the forward pass;
    between steps sequences arrive, fork, finish, are preempted, swapped out or back in, and the prefix cache
    may be reset.

    ``kv`` models the device cache contents (block id -> token id held by each slot), ``host_kv`` the host
    slots (the swap pool, then the host tier of the prefix cache). The forward pass applies the step's
    swap-outs, copy-on-write copies and swap-ins, in that order, then writes each scheduled token's id into
    its slot.
    """

    def __init__(self) -> None:
        super().__init__()
        self.seqs: dict[int, Sequence] = {}  # live: waiting (empty table), running or swapped out
        # ids of swapped-out sequences (empty table, host blocks), in order
        self.swapped: list[int] = []
        self.pending: dict[int, int] = {}  # seq id -> tokens allocated for the coming forward pass
        # ids admitted in the current step (never a victim: admission is last)
        self.admitted: set[int] = set()
        # tokens of sequences gone (finished, aborted)
        self.history: list[tuple[list[int], str | None]] = []
        self.next_id = 0
        self.queries = self.hits = self.evictions = self.host_hits = self.host_stores = 0

    @initialize(
        algo=st.sampled_from(["sha256", "xxh128"]),
        num_blocks=st.integers(6, 10) | st.integers(6, 24),
        num_host_blocks=st.integers(0, 12),
        num_host_cache_blocks=st.just(0) | st.integers(0, 6),
        prompts=st.lists(st.tuples(PROMPTS, SALTS), min_size=1, max_size=4),
    )
    def setup(
        self,
        algo: str,
        num_blocks: int,
        num_host_blocks: int,
        num_host_cache_blocks: int,
        prompts: list[tuple[list[int], str | None]],
    ) -> None:
        self.bm = make_bm(
            num_blocks,
            algo,
            num_host_blocks=num_host_blocks,
            num_host_cache_blocks=num_host_cache_blocks,
        )
        assert (self.bm.host_cache is None) == (num_host_cache_blocks == 0)
        event("host tier" if num_host_cache_blocks else "no host tier")
        self.ref = ReferenceHashes(algo, MODEL, SEED, BS)
        self.kv = {i: [None] * BS for i in range(num_blocks)}
        self.host_kv = {i: [None] * BS for i in range(num_host_blocks + num_host_cache_blocks)}
        for tokens, salt in prompts:
            self.new_seq(tokens, salt)

    # -------- helpers
    def waiting(self) -> list[Sequence]:
        return [s for s in self.seqs.values() if not s.block_table and s.seq_id not in self.swapped]

    def running(self) -> list[Sequence]:
        return [s for s in self.seqs.values() if s.block_table]

    def steppable(self) -> list[Sequence]:
        return [
            s
            for s in self.running()
            if s.seq_id not in self.pending and s.num_uncomputed_tokens > 0
        ]

    def new_seq(
        self, tokens: list[int], salt: str | None, prompt_len: int | None = None
    ) -> Sequence:
        seq = Sequence(
            seq_id=self.next_id,
            request_id=f"r{self.next_id}",
            token_ids=tokens,
            params=SamplingParams(),
            cache_salt=salt,
            num_prompt_tokens=prompt_len or len(tokens),
            retain=self.next_id % 3 == 0,  # (a session's: its freed blocks go to the kept queue)
        )
        self.seqs[seq.seq_id] = seq
        self.next_id += 1
        return seq

    def forget(self, seq: Sequence) -> None:
        del self.seqs[seq.seq_id]
        self.history = (self.history + [(list(seq.token_ids), seq.cache_salt)])[-8:]

    def view(self) -> tuple[dict, dict]:
        """What the coming pass attends to: the contents after this step's pending copies (nothing mutated)."""
        bm = self.bm
        return with_pending(
            self.kv, self.host_kv, bm.pending_swap_out, bm.pending_copies, bm.pending_swap_in
        )

    def host_slot_of(self, block_hash: bytes) -> int | None:
        hc = self.bm.host_cache
        return hc.entries.get(block_hash) if hc is not None else None

    def expected_hits(self, seq: Sequence) -> list[int | tuple[bytes, int]]:
        """Longest run of cached blocks of the reference chain (on the device: the block id, else in the host
        tier: (hash, slot)), leaving at least one token to compute."""
        hits: list[int | tuple[bytes, int]] = []
        for block_hash in self.ref.chain(seq.token_ids, seq.cache_salt)[
            : (seq.num_tokens - 1) // BS
        ]:
            if block_hash in self.bm.pool.cached:
                hits.append(self.bm.pool.cached[block_hash].block_id)
            elif (slot := self.host_slot_of(block_hash)) is not None:
                hits.append((block_hash, slot))
            else:
                break
        return hits

    def admit(self, seq: Sequence, size: int) -> None:
        hits = self.bm.match_prefix(seq)
        assert [hit_key(b) for b in hits] == self.expected_hits(seq)
        if self.try_allocate(seq, 1 + size % (seq.num_tokens - len(hits) * BS), hits):
            self.admitted.add(seq.seq_id)

    def try_allocate(self, seq: Sequence, n: int, hits: list | None = None) -> bool:
        """allocate, checked against a hand count of the free blocks it needs; all or nothing."""
        bm, pool = self.bm, self.bm.pool
        admission = hits is not None
        hits = hits or []
        host_hits = [(i, h) for i, h in enumerate(hits) if isinstance(h, HostHit)]
        computed = seq.num_computed_tokens + len(hits) * BS
        # a host hit's block is taken by the allocation: unknown here (None)
        table = seq.block_table + [b.block_id if isinstance(b, Block) else None for b in hits]
        first, last = computed // BS, (computed + n - 1) // BS  # blocks the pass will write
        assert all(table[i] is not None for i in range(first, min(last + 1, len(table))))
        copies = sum(
            1
            for i in range(first, min(last + 1, len(table)))
            if pool.blocks[table[i]].ref_count > 1
        )
        revived = sum(1 for b in hits if isinstance(b, HostHit) or b.ref_count == 0)
        need = max(0, last + 1 - len(table)) + revived + copies
        before, cached_before = snapshot(bm, list(self.seqs.values())), set(pool.cached)
        free_before, free_ids_before = bm.num_free_blocks, {b.block_id for b in pool.free_blocks()}
        num_copies, num_outs, num_ins = (
            len(bm.pending_copies),
            len(bm.pending_swap_out),
            len(bm.pending_swap_in),
        )
        host_hits_before = bm.lookups.host_hits

        ok = bm.allocate(seq, n, hits) if admission else bm.allocate(seq, n)
        assert ok == (need <= free_before), (
            f"needs {need} blocks, {free_before} free, allocate said {ok}"
        )
        if not ok:
            event("allocation refused")
            assert snapshot(bm, list(self.seqs.values())) == before, (
                "a failed allocation changed state"
            )
            return False
        # (hits follow the blocks seq already held: none on admission)
        offset = len(table) - len(hits)
        assert seq.num_computed_tokens == computed
        kept = [
            b for i, b in enumerate(seq.block_table[: len(table)]) if not (copies and i == first)
        ]
        assert [b if table[i] is not None else None for i, b in enumerate(kept)] == [
            b for i, b in enumerate(table) if not (copies and i == first)
        ]
        # (a swapped-in sequence may hold blocks allocated before it was swapped out, for tokens still to come)
        assert len(seq.block_table) == max(last + 1, len(table)), (
            "table is not exactly the blocks needed"
        )
        for i in range(first, last + 1):  # a pass writes only into blocks its sequence holds alone
            block = pool.blocks[seq.block_table[i]]
            assert block.ref_count == 1 and block.block_hash is None
        new_copies = bm.pending_copies[num_copies:]
        assert len(new_copies) == copies
        for src, dst in new_copies:
            assert table[first] == src and seq.block_table[first] == dst
        # host hits: a fresh block each, registered under the hash at once, its copy back queued in order
        restores = bm.pending_swap_in[num_ins:]
        assert restores == [(h.slot, seq.block_table[offset + i]) for i, h in host_hits], (
            "wrong host restores"
        )
        for i, h in host_hits:
            block = pool.blocks[seq.block_table[offset + i]]
            assert block.block_id in free_ids_before and block.ref_count == 1
            assert block.block_hash == h.block_hash and pool.cached[h.block_hash] is block, (
                "restore not registered"
            )
            assert bm.host_cache.entries.get(h.block_hash) == h.slot
        assert bm.lookups.host_hits - host_hits_before == BS * len(host_hits)
        self.host_hits += BS * len(host_hits)
        # evicted blocks this allocation stored on the host tier (copied in the step's first phase)
        stores = bm.pending_swap_out[num_outs:]
        evicted = cached_before - set(pool.cached)
        if bm.host_cache is None:
            assert not stores
        for block_id, slot in stores:
            assert block_id in free_ids_before and slot >= bm.host.num_blocks
        dev, _ = self.view()
        assert kv_tokens(dev, seq, BS) == seq.token_ids[: seq.num_computed_tokens], (
            "a hit served wrong KV"
        )
        self.evictions += len(evicted)
        if admission:
            self.queries += seq.num_tokens
            self.hits += len(hits) * BS
        self.pending[seq.seq_id] = n
        for name, happened in [
            ("copy-on-write", copies),
            ("prefix hit", hits),
            ("host hit", host_hits),
            ("eviction", evicted),
            ("host store", stores),
        ]:
            if happened:
                event(name)
        return True

    def forward_pass(self, sampled: list[int]) -> None:
        """The step's copies (swap-outs, copy-on-write, swap-ins), then each scheduled token's KV into its slot;
        commit; sample a token at the end (or finish, at MAX_TOKENS)."""
        outs, ins = self.bm.take_pending_swaps()
        copies = self.bm.take_pending_copies()
        # one batched copy each: a duplicate destination has no defined winner
        for pairs in (outs, copies, ins):
            assert len({dst for _, dst in pairs}) == len(pairs), (
                f"duplicate copy destination in {pairs}"
            )
        num_swap = self.bm.host.num_blocks
        self.host_stores += sum(1 for _, slot in outs if slot >= num_swap)
        self.kv, self.host_kv = with_pending(self.kv, self.host_kv, outs, copies, ins)
        batch = [(self.seqs[seq_id], n) for seq_id, n in self.pending.items()]
        for seq, n in batch:
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                block_id = seq.block_table[pos // BS]
                assert self.bm.pool.blocks[block_id].ref_count == 1, "writing into a shared block"
                self.kv[block_id][pos % BS] = seq.token_ids[pos]
        for seq, n in batch:
            seq.num_computed_tokens += n
            self.bm.commit(seq)
            assert seq.num_registered_blocks == seq.num_computed_tokens // BS
        for (seq, _), token in zip(batch, sampled):
            if seq.num_uncomputed_tokens == 0 and seq.num_tokens < MAX_TOKENS:
                seq.append_token(token)
            # finished by length: its blocks stay cached until reused
            elif seq.num_uncomputed_tokens == 0:
                self.bm.free(seq)
                self.forget(seq)
        self.pending = {}
        self.admitted = set()

    def swap_out_seq(self, seq: Sequence) -> None:
        """``bm.swap_out``, checked: one swap slot per block of computed tokens, every block freed, the computed
        tokens kept."""
        bm = self.bm
        computed, num_outs = seq.num_computed_tokens, len(bm.pending_swap_out)
        # only the blocks holding computed tokens go (a preempted step's allocation may have added more)
        whole, table = list(seq.block_table), seq.block_table[: -(-computed // BS)]
        cow = {dst: src for src, dst in bm.pending_copies}
        swap_ins = set(bm.pending_swap_in)
        free_slots = set(bm.host.free) | set(bm.host.freed_this_step)
        bm.swap_out(seq)
        assert seq.block_table == [] and seq.seq_id not in bm.holders
        assert seq.num_computed_tokens == computed, "swap-out dropped computed tokens"
        assert len(seq.host_blocks) == len(table) and set(seq.host_blocks) <= free_slots
        assert not set(seq.host_blocks) & (set(bm.host.free) | set(bm.host.freed_this_step))
        # one copy out per block, read from a pending copy-on-write's source (a block whose swap-in from the
        # same slot is still pending would need none)
        assert bm.pending_swap_out[num_outs:] == [
            (cow.get(b, b), h) for b, h in zip(table, seq.host_blocks) if (h, b) not in swap_ins
        ]
        assert not set(whole) & {dst for _, dst in bm.pending_copies}, (
            "a copy into a swapped-out block remains"
        )
        if set(table) & set(cow):
            event("swap out with a pending copy-on-write")
        self.swapped.append(seq.seq_id)
        event("swap out")

    def engine_step(self, step: Step) -> None:
        # swapped sequences come back in order, then run with the others
        if step.resume and self.swapped:
            self.swap_in_seq(self.seqs[self.swapped[0]])
        for pick, size in step.running:
            if candidates := self.steppable():
                seq = candidates[pick % len(candidates)]
                self.try_allocate(seq, 1 + size % seq.num_uncomputed_tokens)
        for pick, size in step.waiting:
            if candidates := self.waiting():
                self.admit(candidates[pick % len(candidates)], size)
        # a victim preempted after its allocation in this step
        if step.preempt is not None and self.pending:
            victim = self.seqs[list(self.pending)[step.preempt % len(self.pending)]]
            del self.pending[victim.seq_id]
            # the scheduler preempts only while scheduling running (or swapped-in) sequences, before admissions
            if step.swap and victim.seq_id not in self.admitted and self.bm.can_swap_out(victim):
                self.swap_out_seq(victim)
                event("swapped out within a step")
            else:
                self.bm.free(victim)
                event("preempted within a step")
        self.forward_pass(step.sampled)

    # -------- rules: an event between steps, then an engine step (every rule drives the engine, also
    # when hypothesis's swarm testing switches some rules off for a test case)
    @rule(step=STEPS)
    def step_only(self, step: Step) -> None:
        self.engine_step(step)

    @rule(tokens=PROMPTS, salt=SALTS, step=STEPS)
    def add_sequence(self, tokens: list[int], salt: str | None, step: Step) -> None:
        if len(self.seqs) < MAX_SEQS:
            self.new_seq(tokens, salt)
        self.engine_step(step)

    @rule(pick=PICK, extra=st.lists(TOKENS, max_size=4), step=STEPS)
    def resubmit(self, pick: int, extra: list[int], step: Step) -> None:
        """A conversation comes back: an earlier sequence's tokens (prompt and output), maybe more after them,
        long evicted from the device perhaps, but still in the host tier."""
        hc = self.bm.host_cache
        # (salt, token prefix)
        offloaded = [self.ref.origin[h] for h in hc.entries] if hc is not None else []
        returning = self.history + [(list(tokens), salt) for salt, tokens in offloaded]
        if returning and len(self.seqs) < MAX_SEQS:
            tokens, salt = returning[pick % len(returning)]
            self.new_seq((tokens + (extra or [0]))[:16], salt)
        self.engine_step(step)

    @rule(pick=PICK, step=STEPS)
    def fork(self, pick: int, step: Step) -> None:
        """A running sequence forks (n > 1, beams): the child shares its blocks and copies its tokens. The engine
        forks a parent right after the pass that computed its prompt (or beam step), so its table holds just its
        computed tokens; a swapped-in victim may hold blocks beyond them (allocated before it was swapped out),
        and allocate copies only the first block a write touches, so such a sequence is not forked here."""
        running = [
            s
            for s in self.running()
            if len(s.block_table) == self.bm.blocks_needed(s.num_computed_tokens)
        ]
        if running and len(self.seqs) < MAX_SEQS:
            parent = running[pick % len(running)]
            child = self.new_seq(
                list(parent.token_ids), parent.cache_salt, parent.num_prompt_tokens
            )
            self.bm.fork(parent, child)
            assert child.block_table == parent.block_table
            assert child.num_computed_tokens == parent.num_computed_tokens
            self.check()
        self.engine_step(step)

    @rule(pick=PICK, finish=st.booleans(), step=STEPS)
    def free(self, pick: int, finish: bool, step: Step) -> None:
        """Finish or abort (the sequence goes away), or preempt (back to waiting, recomputed later); a swapped
        sequence's host blocks are dropped too."""
        if seqs := list(self.seqs.values()):
            seq = seqs[pick % len(seqs)]
            if seq.seq_id in self.swapped:
                self.drop_host(seq)
            self.bm.free(seq)
            assert seq.block_table == [] and seq.num_computed_tokens == 0
            if finish:
                self.forget(seq)
            self.check()
        self.engine_step(step)

    def drop_host(self, seq: Sequence) -> None:
        slots, free_before = list(seq.host_blocks), list(self.bm.host.free)
        self.bm.drop_host_blocks(seq)
        assert seq.host_blocks == [] and sorted(self.bm.host.free) == sorted(free_before + slots)
        self.swapped.remove(seq.seq_id)

    @rule(pick=PICK, step=STEPS)
    def swap_out(self, pick: int, step: Step) -> None:
        """Preemption by swapping: a running sequence's blocks go to the swap pool (a forked sibling keeps
        the blocks they share)."""
        if (running := self.running()) and self.bm.can_swap_out(
            seq := running[pick % len(running)]
        ):
            self.swap_out_seq(seq)
            self.check()
        elif running:
            event("swap out refused")
        self.engine_step(step)

    @rule(pick=PICK, step=STEPS)
    def swap_in(self, pick: int, step: Step) -> None:
        """A swapped sequence comes back into fresh blocks; the pass of this step copies its KV in first."""
        if self.swapped:
            self.swap_in_seq(self.seqs[self.swapped[pick % len(self.swapped)]])
        self.engine_step(step)

    def swap_in_seq(self, seq: Sequence) -> bool:
        """``bm.swap_in`` when it can, checked: fresh blocks, the copies back queued, the computed tokens kept
        (read back by the coming pass), the host slots held until the step's copies ran."""
        bm, pool = self.bm, self.bm.pool
        if not bm.can_swap_in(seq):
            assert len(seq.host_blocks) > bm.num_free_blocks
            event("swap in refused")
            return False
        slots, computed = list(seq.host_blocks), seq.num_computed_tokens
        free_ids, cached_before, num_ins = (
            {b.block_id for b in pool.free_blocks()},
            set(pool.cached),
            len(bm.pending_swap_in),
        )
        num_outs = len(bm.pending_swap_out)
        bm.swap_in(seq)
        assert len(seq.block_table) == len(slots) and set(seq.block_table) <= free_ids
        assert all(
            pool.blocks[b].ref_count == 1 and pool.blocks[b].block_hash is None
            for b in seq.block_table
        )
        assert (
            seq.host_blocks == []
            and seq.num_computed_tokens == computed
            and seq.num_registered_blocks == 0
        )
        assert bm.holders.get(seq.seq_id) is seq
        assert bm.pending_swap_in[num_ins:] == list(zip(slots, seq.block_table))
        assert set(slots) <= set(bm.host.freed_this_step), (
            "swap slots reused while this step still reads them"
        )
        stores = bm.pending_swap_out[num_outs:]
        assert all(slot >= bm.host.num_blocks for _, slot in stores)
        self.evictions += len(cached_before - set(pool.cached))
        if stores:
            event("host store")
        self.swapped.remove(seq.seq_id)
        dev, _ = self.view()
        assert kv_tokens(dev, seq, BS) == seq.token_ids[:computed], (
            "a swapped-in sequence reads foreign KV"
        )
        event("swap in")
        return True

    @rule(pick=PICK, step=STEPS)
    def drop_swapped(self, pick: int, step: Step) -> None:
        """A swapped-out sequence finishes (aborted, or its request ended): its host blocks are freed."""
        if self.swapped:
            seq = self.seqs[self.swapped[pick % len(self.swapped)]]
            self.drop_host(seq)
            self.bm.free(seq)
            self.forget(seq)
            event("swapped sequence dropped")
            self.check()
        self.engine_step(step)

    @rule(step=STEPS)
    def reset_prefix_cache(self, step: Step) -> None:
        free_hashed = sum(1 for b in self.bm.pool.free_blocks() if b.block_hash is not None)
        host_entries = len(self.bm.host_cache.entries) if self.bm.host_cache is not None else 0
        assert self.bm.reset_prefix_cache() == free_hashed + host_entries
        assert all(b.block_hash is None for b in self.bm.pool.free_blocks())
        assert self.bm.host_cache is None or not self.bm.host_cache.entries
        self.check()
        self.engine_step(step)

    @rule(pick=PICK, pin=st.integers(0, 2), cap=st.integers(0, 8), step=STEPS)
    def pin(self, pick: int, pin: int, cap: int, step: Step) -> None:
        """A preset pins the cached head blocks of a sequence's tokens, within a cap on all pins."""
        if seqs := list(self.seqs.values()):
            seq = seqs[pick % len(seqs)]
            chain = self.ref.chain(seq.token_ids, seq.cache_salt)
            head = 0
            while head < len(chain) and chain[head] in self.bm.pool.cached:
                head += 1
            others = sum(len(ids) for pin_id, ids in self.bm.pins.items() if pin_id != f"p{pin}")
            expected = head if 0 < head and others + head <= cap else 0
            assert self.bm.pin(f"p{pin}", chain, cap) == expected
            event("pinned" if expected else "pin refused")
            self.check()
        self.engine_step(step)

    @rule(step=STEPS)
    def release_pins_under_pressure(self, step: Step) -> None:
        """The scheduler, stalled by pins, drops them all: blocks only pins held become free (still cached)."""
        pin_refs: dict[int, int] = {}
        for ids in self.bm.pins.values():
            for block_id in ids:
                pin_refs[block_id] = pin_refs.get(block_id, 0) + 1
        pinned_only = sum(1 for b, n in pin_refs.items() if self.bm.pool.blocks[b].ref_count == n)
        free_before, cached_before = self.bm.num_free_blocks, set(self.bm.pool.cached)
        assert self.bm.unpin_all() == sum(pin_refs.values())
        assert self.bm.num_pinned_blocks == 0
        assert self.bm.num_free_blocks == free_before + pinned_only
        assert set(self.bm.pool.cached) == cached_before  # released, not forgotten: still hittable
        self.check()
        self.engine_step(step)

    # -------- invariants
    @invariant()
    def between_steps(self) -> None:
        """After every rule (its engine step ran): nothing is left pending, and everything checks out."""
        bm = self.bm
        assert (
            not self.pending
            and not bm.pending_copies
            and not bm.pending_swap_out
            and not bm.pending_swap_in
        )
        assert not bm.host.freed_this_step and (bm.host_cache is None or not bm.host_cache.busy)
        self.check()

    def check(self) -> None:
        """Bookkeeping is consistent, every sequence reads its own tokens (a swapped one from its host blocks),
        cached blocks hold their tokens, on the device and in the host tier. Called mid-rule too (between a
        rule's event and its engine step), where the contents are those the coming pass will see."""
        bm = self.bm
        seqs = list(self.seqs.values())
        swapped = [self.seqs[i] for i in self.swapped]
        assert set(self.swapped) <= set(self.seqs) and len(set(self.swapped)) == len(self.swapped)
        check_pool(bm, seqs)
        s = bm.stats()
        assert (s.prefix_queries, s.prefix_hits, s.evictions) == (
            self.queries,
            self.hits,
            self.evictions,
        )
        pending_stores = sum(1 for _, slot in bm.pending_swap_out if slot >= bm.host.num_blocks)
        assert (s.prefix_host_hits, s.host_cache_stores) == (
            self.host_hits,
            self.host_stores + pending_stores,
        )
        hc = bm.host_cache
        assert s.num_host_cached_blocks == (len(hc.entries) if hc is not None else 0)
        kv, host_kv = self.view()
        check_contents(bm, [q for q in seqs if q.seq_id not in self.swapped], kv, self.ref)
        check_host(bm, seqs, swapped, host_kv, self.ref)


# derandomized (the seed is a hash of the test): every run tries the same 300 programs and takes the same time
BlockManagerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
