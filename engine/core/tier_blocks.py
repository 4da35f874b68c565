"""The core's books of the KV tiers below the host (engine/kv_tiers/: disk, Redis): which blocks go down, which come
back up, and which hashes a waiting request waits for.

- **Down**: when a session's turn ends (a sequence with ``retain``), its written full blocks that the tiers do not
  hold yet are saved: each keeps one more reference until the tiers' thread has copied its bytes out (then it may be
  reused), and the writes run on that thread.
- **Up**: when a request arrives (or a session is warmed: ``warm``), the hashes of its prompt past what the device
  and the host tier hold are looked up: those the disk tier holds (its index is in memory) get fresh device blocks,
  held until the thread has read, checked and copied their KV in; then each is registered under its hash and
  released, a cached block like any other. With Redis, the hashes past the disk's are first asked for in one round
  trip (a probe), then loaded the same way. Meanwhile those hashes count as *in progress* (``loading``): the
  scheduler holds a request whose next uncached block is among them, as it does for a block another request is
  computing, and admits it with the hit once the block is cached; a block that fails to load is computed instead.

A block ``key`` is the chain hash joined with the engine's fingerprint (engine/kv_tiers/fingerprint.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.core.block_pool import Block, BlockPool
from engine.core.host_prefix_cache import HostPrefixCache
from engine.kv_tiers.fingerprint import tier_key
from engine.kv_tiers.tier_io import LOAD, PROBE, SAVE, TierDone, TierIO, TierJob
from engine.sequence import Sequence

# blocks leaving the host tier copied out per step (~0.1 ms each in the step loop); the rest are lost
MAX_HOST_COPIES_PER_STEP = 64
# keys saved lately (being written, or to Redis alone, with no disk index to ask): each is saved once
REMEMBERED_SAVES = 1 << 16


@dataclass(slots=True)
class TierCounts:
    """Cumulative, in blocks (the stats turn them into tokens) and seconds."""

    disk_hits: int = 0  # blocks loaded from disk
    redis_hits: int = 0  # blocks loaded from Redis
    saved: int = 0  # blocks handed to the tiers for writing
    not_saved: int = 0  # blocks a save left out (too many blocks held for saves already)
    restore_seconds: float = 0.0  # the loads' time, read to copied in


class TierBlocks:
    def __init__(
        self,
        pool: BlockPool,
        host_cache: HostPrefixCache | None,
        io: TierIO,
        fingerprint: bytes,
    ) -> None:
        self.pool = pool
        self.host_cache = host_cache
        self.io = io
        self.fingerprint = fingerprint
        self.counts = TierCounts()
        # block hash -> the device block being filled for it (None: asked of Redis, no block yet)
        self.loading: dict[bytes, Block | None] = {}
        self._jobs: dict[int, tuple[TierJob, list[bytes], list[Block]]] = {}  # in flight
        self._saved: OrderedDict[bytes, None] = OrderedDict()
        # at most this many blocks held for saves and loads together: the rest of the pool stays for the batch
        self.max_held = max(1, len(pool.blocks) // 4)
        self.num_held = 0
        # blocks copied out of the host tier in this step (at most MAX_HOST_COPIES_PER_STEP, in the step loop)
        self.host_copies = 0
        if host_cache is not None and io.host is not None:
            host_cache.on_drop = self._save_from_host

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    def held_blocks(self) -> list[int]:
        """The device blocks the tiers hold one reference to each (saves being copied out, loads being filled)."""
        return [block.block_id for _, _, blocks in self._jobs.values() for block in blocks]

    def key(self, block_hash: bytes) -> bytes:
        return tier_key(self.fingerprint, block_hash)

    # up ---------------------------------------------------------------------------------------------------

    def fetch(self, block_hashes: list[bytes], limit: int) -> int:
        """Start bringing back the blocks of ``block_hashes[:limit]`` (a chain, head first) that neither the
        device nor the host tier holds and a lower tier does; the number of blocks on their way."""
        first = self._first_missing(block_hashes, limit)
        on_disk = []
        disk = self.io.disk
        for block_hash in block_hashes[first:limit]:
            if block_hash in self.loading:
                continue
            if disk is None or not disk.contains(self.key(block_hash)):
                break
            on_disk.append(block_hash)
        queued = self._load(on_disk)
        rest = block_hashes[first + len(on_disk) : limit]
        if queued == len(on_disk) and rest and self.io.redis is not None:
            self._probe(rest)
        return queued

    def _first_missing(self, block_hashes: list[bytes], limit: int) -> int:
        host = self.host_cache
        for i, block_hash in enumerate(block_hashes[:limit]):
            if block_hash not in self.pool.cached and (
                host is None or host.get(block_hash) is None
            ):
                return i
        return limit

    def _load(self, block_hashes: list[bytes]) -> int:
        room = min(self.max_held - self.num_held, self.pool.num_free - len(self.pool.blocks) // 8)
        block_hashes = [h for h in block_hashes if h not in self.loading][: max(room, 0)]
        if not block_hashes:
            return 0
        # (an evicted block is not kept on the host here: its copy would race the load's writes into it)
        blocks = [self.pool.take(keep_evicted=False) for _ in block_hashes]
        self.loading.update(zip(block_hashes, blocks))
        self._submit(LOAD, block_hashes, blocks)
        return len(blocks)

    def _probe(self, block_hashes: list[bytes]) -> None:
        block_hashes = [h for h in block_hashes if h not in self.loading]
        if block_hashes:
            self.loading.update((h, None) for h in block_hashes)
            self._submit(PROBE, block_hashes, [])

    # down -------------------------------------------------------------------------------------------------

    def save(self, seq: Sequence) -> int:
        """Hand the written full blocks of ``seq`` that the tiers lack to them (before ``seq`` frees them); the
        number handed."""
        disk = self.io.disk
        hashes, blocks = [], []
        for block_hash, block_id in zip(
            seq.block_hashes[: seq.num_registered_blocks], seq.block_table
        ):
            key = self.key(block_hash)
            held = key in self._saved or (disk is not None and disk.contains(key))
            if not held:
                hashes.append(block_hash)
                blocks.append(self.pool.blocks[block_id])
        room = max(self.max_held - self.num_held, 0)
        self.counts.not_saved += max(len(blocks) - room, 0)
        hashes, blocks = hashes[:room], blocks[:room]
        if not blocks:
            return 0
        for block in blocks:
            self.pool.acquire(block)
        for block_hash in hashes:
            self._remember(self.key(block_hash))
        self._submit(SAVE, hashes, blocks)
        self.counts.saved += len(blocks)
        return len(blocks)

    def _save_from_host(self, block_hash: bytes, slot: int) -> None:
        """A block leaves the host tier: its KV, still in its slot, copied out now (before this step's copies
        reuse the slot) and written by the tiers' thread, unless a lower tier holds it already."""
        key = self.key(block_hash)
        if key in self._saved or (self.io.disk is not None and self.io.disk.contains(key)):
            return
        if self.host_copies >= MAX_HOST_COPIES_PER_STEP:
            self.counts.not_saved += 1
            return
        self.host_copies += 1
        self._remember(key)
        job = TierJob(SAVE, [key], payloads=[self.io.host.copy_out(slot)])
        self.io.submit(job)
        self._jobs[job.job_id] = (job, [block_hash], [])
        self.counts.saved += 1

    def _remember(self, key: bytes) -> None:
        self._saved[key] = None
        if len(self._saved) > REMEMBERED_SAVES:
            self._saved.popitem(last=False)

    # between steps ----------------------------------------------------------------------------------------

    def _submit(self, kind: int, block_hashes: list[bytes], blocks: list[Block]) -> None:
        keys = [self.key(h) for h in block_hashes]
        job = TierJob(kind, keys, [b.block_id for b in blocks])
        self.io.submit(job)
        self._jobs[job.job_id] = (job, block_hashes, blocks)
        self.num_held += len(blocks)

    def poll(self, timeout_s: float = 0.0) -> int:
        """Settle what the tiers' thread finished (waiting up to ``timeout_s`` for something when a job is in
        flight); the number of jobs settled."""
        self.host_copies = 0
        done = self.io.take_done(timeout_s if self._jobs else 0.0)
        for result in done:
            self._settle(result)
        return len(done)

    def _settle(self, result: TierDone) -> None:
        job, block_hashes, blocks = self._jobs.pop(result.job.job_id)
        self.num_held -= len(blocks)
        if job.kind == PROBE:
            for block_hash in block_hashes:
                self.loading.pop(block_hash, None)
            self._load(block_hashes[: result.present])
            return
        for block_hash, block, source in zip(block_hashes, blocks, result.sources, strict=False):
            if job.kind == LOAD:
                self.loading.pop(block_hash, None)
                if source:
                    self.pool.register(block, block_hash)
                    self.counts.disk_hits += source == "disk"
                    self.counts.redis_hits += source == "redis"
            self.pool.release(block, keep=True)  # (a session's block, as the saves are)
        if job.kind == LOAD:
            self.counts.restore_seconds += result.seconds

    def close(self) -> None:
        self.io.close()
