"""The KV tiers below the host (engine/kv_tiers/, engine/core/tier_blocks.py): a session's turn leaves its blocks on
disk (and in Redis); an engine started later over the same directory (or Redis) reads them back on a prefix hit,
and its greedy tokens equal those of an engine that recomputes everything. Another tenant's salt never hits them; a
corrupted file, a full disk and a Redis killed mid-read cost only the blocks concerned (recomputed), never the
request; the block books stay consistent at every step."""

from __future__ import annotations

import errno
import gc
import logging
import os
import shutil
import signal
import weakref
from pathlib import Path

import pytest

from engine.core.block_pool import BlockPool
from engine.kv_tiers import block_file
from engine.kv_tiers.disk_store import DiskStore
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.runtime import core_process
from engine.sampling_params import SamplingParams
from tests.block_invariants import check_pool

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SMALL = {"num_kv_blocks": 48, "max_model_len": 256}
TURN = (
    "You are a careful travel assistant. Answer in one short paragraph and keep a friendly tone. The user "
    "is planning a week of walking in the mountains in late autumn and wants to know about the weather, "
    "the trails that stay open, and what to pack for cold nights in the huts."
)
NEXT = " Thank you. And which of those trails suits a beginner?"


def written_blocks(num_prompt_tokens: int) -> int:
    """Full blocks a greedy turn leaves written: its prompt and its tokens but the last (never computed)."""
    return (num_prompt_tokens + GREEDY.max_tokens - 1) // 16


def run(engine: LLMEngine, request_id: str, ids: list[int], **options) -> tuple[list[int], int]:
    """Greedy tokens and cached prompt tokens, the block books checked at every step; the tiers' writes
    finished before returning."""
    engine.add_request(request_id, ids, GREEDY, **options)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
        scheduler = engine.core.scheduler
        check_pool(
            engine.core.block_manager,
            list(scheduler.running) + list(scheduler.waiting) + list(scheduler.swapped),
            scheduler.tiers,
        )
    assert engine.core.flush_kv_tiers(30.0)
    check_pool(engine.core.block_manager, [])
    return final.token_ids, final.num_cached_tokens


def tiered(disk: Path | None, redis_url: str | None = None) -> LLMEngine:
    size = 64 * 2**20 if disk is not None else 0
    return LLM(
        kv_disk_path=str(disk) if disk else None, kv_disk_size=size, kv_redis_url=redis_url, **SMALL
    ).engine


@pytest.fixture(scope="module")
def prompts(tokenizer) -> tuple[list[int], list[int]]:
    """The first turn's prompt, and the second's start (the first turn's prompt, its reply, the next message)."""
    first = tokenizer.encode(TURN)
    reply = cold_engine_result(first)
    return first, first + reply + tokenizer.encode(NEXT)


_COLD: dict[tuple[int, ...], list[int]] = {}
_COLD_ENGINE: list[LLMEngine] = []


def cold_engine_result(ids: list[int]) -> list[int]:
    """Greedy tokens of an engine without the lower tiers whose cache never saw ``ids``."""
    if tuple(ids) not in _COLD:
        if not _COLD_ENGINE:
            _COLD_ENGINE.append(LLM(kv_disk_size=0, enable_prefix_caching=False, **SMALL).engine)
        _COLD[tuple(ids)] = run(_COLD_ENGINE[0], f"cold-{len(_COLD)}", ids)[0]
    return _COLD[tuple(ids)]


@pytest.fixture(scope="module")
def written(tmp_path_factory, prompts) -> Path:
    """A disk tier holding a session's first turn (written by an engine that is gone since)."""
    disk = tmp_path_factory.mktemp("kv-disk")
    engine = tiered(disk)
    tokens, _ = run(engine, "turn-1", prompts[0], cache_salt="tenant-a", retain=True)
    assert tokens == cold_engine_result(prompts[0])
    stats = engine.stats()
    assert stats.num_disk_blocks == written_blocks(len(prompts[0])) == len(block_files(disk))
    assert stats.kv_tier_written_bytes > 0
    engine.shutdown()
    return disk


def block_files(disk: Path) -> list[Path]:
    return sorted(disk.glob("??/*.kvb"))


def test_next_turn_after_a_restart_reads_the_first_from_disk(written, prompts, tmp_path, caplog):
    copy = shutil.copytree(written, tmp_path / "kv")
    engine = tiered(copy)
    before = engine.stats()
    tokens, cached = run(engine, "turn-2", prompts[1], cache_salt="tenant-a", retain=True)
    assert tokens == cold_engine_result(prompts[1])
    on_disk = written_blocks(len(prompts[0])) * 16
    assert cached >= on_disk
    stats = engine.stats()
    assert stats.prefix_disk_hits == on_disk and stats.kv_tier_read_bytes > 0
    assert stats.kv_tier_rejected_blocks == 0
    # the second turn's own blocks went down too
    assert stats.num_disk_blocks == written_blocks(len(prompts[1])) == len(block_files(copy))
    # the engine line tells the tiers' part
    step_log = core_process.StepLog(10.0)
    step_log._steps, step_log._step_s = 1, 0.01
    with caplog.at_level(logging.INFO, logger=core_process.logger.name):
        step_log._log(before, stats, 1.0)
    assert f"KV tiers: {on_disk} prompt tokens from disk, 0 from Redis" in caplog.text
    assert f"{stats.num_disk_blocks} blocks on disk; 0 refused" in caplog.text
    engine.shutdown()


def test_another_tenants_salt_never_hits_the_disk_blocks(written, prompts, tmp_path):
    engine = tiered(written)
    tokens, cached = run(engine, "other", prompts[1], cache_salt="tenant-b")
    assert cached == 0 and engine.stats().prefix_disk_hits == 0
    assert tokens == cold_engine_result(prompts[1])
    engine.shutdown()


def test_a_corrupted_block_file_is_recomputed_and_deleted(written, prompts, tmp_path):
    disk = shutil.copytree(written, tmp_path / "kv")
    files = block_files(disk)
    victim = files[len(files) // 2]
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF  # (a bit flipped in the payload: only the checksum can tell)
    victim.write_bytes(bytes(data))
    engine = tiered(disk)
    tokens, cached = run(engine, "turn-2", prompts[1], cache_salt="tenant-a")
    assert tokens == cold_engine_result(prompts[1])
    stats = engine.stats()
    assert stats.kv_tier_rejected_blocks == 1 and not victim.exists()
    assert 0 < stats.prefix_disk_hits < written_blocks(len(prompts[0])) * 16
    engine.shutdown()


def test_a_full_disk_loses_the_copies_not_the_answer(prompts, tmp_path, monkeypatch):
    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).startswith(str(tmp_path)):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", full_disk)
    engine = tiered(tmp_path / "kv")
    tokens, _ = run(engine, "full", prompts[0], retain=True)
    assert tokens == cold_engine_result(prompts[0])
    store = engine.core.scheduler.tiers.io.disk
    assert store.counts.write_failures == written_blocks(len(prompts[0])) and len(store) == 0
    assert not list((tmp_path / "kv").rglob("*.*"))  # (nothing half-written left)
    engine.shutdown()


def test_warm_brings_a_session_back_before_its_turn(written, prompts):
    engine = tiered(written)
    ids = prompts[1][
        : written_blocks(len(prompts[0])) * 16
    ]  # (what the session stored: the first turn)
    assert engine.core.warm_prefix(ids, "tenant-a") == written_blocks(len(prompts[0]))
    assert engine.core.flush_kv_tiers(30.0)
    pool = engine.core.block_manager.pool
    assert len(pool.cached) == written_blocks(len(prompts[0]))  # (on the device before the request)
    tokens, cached = run(engine, "turn-2", prompts[1], cache_salt="tenant-a")
    assert tokens == cold_engine_result(prompts[1]) and cached >= len(ids)
    assert engine.core.warm_prefix(ids, "tenant-a") == 0  # (already there)
    engine.shutdown()


def first_turn_in_redis(url: str, prompt: list[int], salt: str) -> None:
    """A session's first turn run by an engine with only the Redis tier, which is gone since."""
    engine = tiered(None, url)
    run(engine, "turn-1", prompt, cache_salt=salt, retain=True)
    engine.shutdown()


def test_a_second_engine_on_the_same_redis_serves_the_next_turn(redis_server, prompts):
    first_turn_in_redis(redis_server.url, prompts[0], "tenant-a")
    second = tiered(None, redis_server.url)
    tokens, cached = run(second, "turn-2", prompts[1], cache_salt="tenant-a")
    assert tokens == cold_engine_result(prompts[1])
    assert cached >= written_blocks(len(prompts[0])) * 16
    assert second.stats().prefix_redis_hits == written_blocks(len(prompts[0])) * 16
    _, cached = run(second, "other", prompts[1], cache_salt="tenant-b")
    assert cached == 0
    second.shutdown()


def test_redis_killed_mid_read_answers_from_recompute(redis_server, prompts):
    first_turn_in_redis(redis_server.url, prompts[0], "tenant-c")
    engine = tiered(None, redis_server.url)
    store = engine.core.scheduler.tiers.io.redis
    real_get = store.client.get

    def get_after_kill(*args, **kwargs):
        if redis_server.process is not None and redis_server.process.poll() is None:
            os.kill(redis_server.process.pid, signal.SIGKILL)
            redis_server.process.wait()
        return real_get(*args, **kwargs)

    store.client.get = get_after_kill
    try:
        tokens, _ = run(engine, "turn-2", prompts[1], cache_salt="tenant-c")
        assert tokens == cold_engine_result(prompts[1])
        assert engine.stats().prefix_redis_hits == 0
    finally:
        redis_server.start()  # (for any later test of the module)
    engine.shutdown()


# the stores and the pool, alone --------------------------------------------------------------------------


def test_block_file_refuses_torn_renamed_and_flipped_blocks():
    key, payload = b"k" * 32, bytes(range(256)) * 4
    parts = [memoryview(payload[:100]), memoryview(payload[100:])]
    data = block_file.encode(key, parts)
    out = [memoryview(bytearray(100)), memoryview(bytearray(len(payload) - 100))]
    block_file.decode_into(data, out, key)
    assert b"".join(bytes(part) for part in out) == payload
    flipped = bytearray(data)
    flipped[block_file.HEADER.size + 7] ^= 1
    for bad, other_key in ((data[:-1], key), (data, b"x" * 32), (bytes(flipped), key)):
        with pytest.raises(block_file.CorruptBlock):
            block_file.decode_into(bad, out, other_key)


def test_disk_store_keeps_its_bound_and_its_order_across_a_restart(tmp_path):
    payload = [memoryview(os.urandom(1000))]
    size = block_file.HEADER.size + 1000
    store = DiskStore(tmp_path, capacity_bytes=3 * size)
    keys = [bytes([i]) * 32 for i in range(4)]
    for key in keys[:3]:
        assert store.write(key, payload)
    out = [memoryview(bytearray(1000))]
    assert store.read_into(keys[0], out) and bytes(out[0]) == bytes(payload[0])
    # (keys[0] is now the most recent)
    os.utime(store.path_of(keys[1]), ns=(1, 1))
    os.utime(store.path_of(keys[2]), ns=(2, 2))
    (store.path_of(keys[3]).parent).mkdir(exist_ok=True)
    stray = store.path_of(keys[3]).with_name("stray.123.456.partial")
    stray.write_bytes(b"half")
    again = DiskStore(tmp_path, capacity_bytes=3 * size)  # a restart
    assert not stray.exists() and len(again) == 3
    assert again.write(keys[3], payload)
    assert not again.contains(keys[1]) and not store.path_of(keys[1]).exists()
    assert all(again.contains(k) for k in (keys[0], keys[2], keys[3]))
    assert again.size_bytes == 3 * size


def test_a_sessions_freed_blocks_are_evicted_after_one_off_blocks():
    pool = BlockPool(4)
    blocks = [pool.take() for _ in range(4)]
    for i, block in enumerate(blocks):
        pool.register(block, bytes([i]))
    pool.release(blocks[0], keep=True)  # a session's, freed first (least recent)
    pool.release(blocks[1])
    pool.release(blocks[2], keep=True)
    pool.release(blocks[3])
    order = [pool.take().block_id for _ in range(4)]
    assert order == [1, 3, 0, 2]


def test_blocks_leaving_the_host_tier_go_down_to_disk(prompts, tokenizer, tmp_path):
    """No session here: one-off prompts pushed out of a small device pool into a host tier of four blocks, and
    out of that to disk; a later engine finds the first prompt there."""
    options = {**SMALL, "num_kv_blocks": 16, "host_cache_gib": 4 * 737280 / 2**30}
    first = LLM(kv_disk_path=str(tmp_path), kv_disk_size=64 * 2**20, **options).engine
    assert first.core.block_manager.host_cache.num_slots == 4
    run(first, "one-off", prompts[0])
    for i, text in enumerate(
        ["Write a haiku about the sea.", "List five primes.", "Name a red bird."]
    ):
        run(first, f"filler-{i}", tokenizer.encode(text * 25))
    stats = first.stats()
    assert stats.host_cache_stores > 4 and stats.num_disk_blocks >= written_blocks(len(prompts[0]))
    first.shutdown()
    later = tiered(tmp_path)
    tokens, cached = run(later, "again", prompts[1])
    assert tokens == cold_engine_result(prompts[1])
    assert cached > 0 and later.stats().prefix_disk_hits == cached
    later.shutdown()


def test_an_engine_dropped_without_shutdown_frees_its_kv(prompts, tmp_path):
    """The tiers' I/O thread holds the engine's KV only while it runs a job: an engine dropped without shutdown
    (a benchmark's, a script's) gives its KV back, and the thread ends."""
    engine = tiered(tmp_path / "kv")
    run(engine, "dropped", prompts[0])
    tiers = engine.core.scheduler.tiers
    kv, thread = weakref.ref(engine.runner.kv.k_caches), tiers.io._thread
    assert thread.is_alive()
    del engine, tiers
    gc.collect()
    thread.join(10)
    assert not thread.is_alive(), "the I/O thread ended with its engine"
    assert kv() is None, "the KV cache was freed"
