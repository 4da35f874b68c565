"""The lower tiers' I/O, on a thread of its own: whole blocks copied out of the KV tensors and written to the stores
(disk, then Redis), or read from the stores, checked and copied into device blocks the core set aside for them.

The core (engine/core/tier_blocks.py) submits jobs and collects what is done between steps; this side never touches
the core's books. A save copies its blocks out first and reports at once (the core releases them), then writes; a
load reports once its blocks hold their KV (on CUDA: after its own stream's copies finished). Loads go before saves:
a request waits for them. A job that fails reports its blocks not done: they are recomputed.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # (the redis client is imported only where the tier is on)
    from engine.kv_tiers.redis_store import RedisStore

from engine.kv_tiers.block_file import Parts
from engine.kv_tiers.disk_store import DiskStore

logger = logging.getLogger(__name__)

LOAD, PROBE, SAVE = 0, 1, 2  # job kinds, in the order the thread takes them
STAGING_BYTES = 256 * 2**20  # a load's blocks pass through a host buffer of at most this size


@dataclass(slots=True)
class TierJob:
    kind: int
    keys: list[bytes]
    block_ids: list[int] = field(default_factory=list)  # device blocks read (save) or filled (load)
    payloads: list[bytes] = field(
        default_factory=list
    )  # a save's blocks copied out already (the host tier's)
    job_id: int = 0


@dataclass(slots=True)
class TierDone:
    job: TierJob
    # per block: load: "disk" | "redis" | "" (not loaded); save: copied out; probe: the keys present, from the first
    sources: list[str] = field(default_factory=list)
    present: int = 0
    seconds: float = 0.0


def _serve(tier_io: weakref.ref[TierIO], jobs: queue.PriorityQueue) -> None:
    """The I/O thread: each job as it comes, until the stop mark (``close``, or the TierIO collected)."""
    while True:
        _, _, job = jobs.get()
        owner = tier_io()
        if job is None or owner is None:
            return
        owner._run(job)
        del owner


class BlockBytes:
    """Whole blocks of the KV tensors (``[layers, blocks, block_size, kv_heads, head_dim]``) as stored payloads: K of
    every layer, then V. On the CPU a block's payload is read and written in place, as the views of its layers
    (``views``); on CUDA it passes through a host staging buffer (``gather``, ``staging`` + ``scatter``)."""

    def __init__(self, k_caches: torch.Tensor, v_caches: torch.Tensor) -> None:
        self.k, self.v = k_caches, v_caches
        self.device = k_caches.device
        # [2, layers, block_size, kv_heads, head_dim] of one block
        self.block_shape = (2, k_caches.shape[0], *k_caches.shape[2:])
        self.payload_size = 2 * k_caches[:, 0].numel() * k_caches.element_size()
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._staging: torch.Tensor | None = None
        self.in_place = self.device.type == "cpu" and k_caches[0, 0].is_contiguous()
        if self.in_place:
            self._arrays = [c.view(torch.uint8).numpy() for c in (k_caches, v_caches)]

    def views(self, block_id: int) -> list[memoryview]:
        """The parts of a block's payload where they live (CPU): each layer's K, then each layer's V."""
        return [
            memoryview(a[layer, block_id]).cast("B")
            for a in self._arrays
            for layer in range(len(a))
        ]

    def copy_out(self, block_id: int) -> bytes:
        """A copy of a block's payload (CPU tensors)."""
        return b"".join(self.views(block_id))

    def _on_stream(self) -> contextlib.AbstractContextManager:
        return (
            torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        )

    def gather(self, block_ids: list[int]) -> np.ndarray:
        """``[n, payload_size]`` bytes on the host."""
        with self._on_stream():
            index = torch.tensor(block_ids, device=self.device)
            both = torch.stack((self.k.index_select(1, index), self.v.index_select(1, index)))
            rows = both.permute(2, 0, 1, 3, 4, 5).reshape(len(block_ids), -1).view(torch.uint8)
            host = rows.cpu()
        return host.numpy()

    def staging(self, num_blocks: int) -> torch.Tensor:
        """A reused host buffer of ``num_blocks`` payloads (pinned on CUDA, so the copy to the device is a DMA
        transfer), grown as needed."""
        if self._staging is None or self._staging.shape[0] < num_blocks:
            self._staging = torch.zeros(
                (num_blocks, self.payload_size),
                dtype=torch.uint8,
                pin_memory=self.stream is not None,
            )
        return self._staging[:num_blocks]

    def scatter(self, block_ids: list[int], payloads: torch.Tensor) -> None:
        """Write ``[n, payload_size]`` host bytes into the device blocks ``block_ids``."""
        with self._on_stream():
            data = payloads.to(self.device, non_blocking=True)
            blocks = data.view(self.k.dtype).reshape(len(block_ids), *self.block_shape)
            index = torch.tensor(block_ids, device=self.device)
            self.k.index_copy_(1, index, blocks[:, 0].transpose(0, 1))
            self.v.index_copy_(1, index, blocks[:, 1].transpose(0, 1))
        if self.stream is not None:
            self.stream.synchronize()


class TierIO:
    def __init__(
        self,
        blocks: BlockBytes,
        disk: DiskStore | None,
        redis: RedisStore | None,
        num_readers: int = 4,
        host: BlockBytes | None = None,
    ) -> None:
        """``blocks``: the device's KV; ``host``: the host tier's (blocks leaving it are copied out of it)."""
        self.blocks = blocks
        self.host = host
        self.disk = disk
        self.redis = redis
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._done: queue.SimpleQueue[TierDone] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._pending = 0  # jobs submitted and not finished (saves: not written yet)
        self._idle = threading.Condition()
        self._readers = ThreadPoolExecutor(num_readers, thread_name_prefix="pagedchat-kv-read")
        # the thread holds this object only while it runs a job: an engine dropped without close() frees its KV
        # (and the thread ends, told by the finalizer)
        self._thread = threading.Thread(
            target=_serve,
            args=(weakref.ref(self), self._jobs),
            name="pagedchat-kv-tiers",
            daemon=True,
        )
        self._thread.start()
        weakref.finalize(self, self._jobs.put, (-1, 0, None))

    @property
    def payload_size(self) -> int:
        return self.blocks.payload_size

    def submit(self, job: TierJob) -> int:
        job.job_id = next(self._ids)
        with self._idle:
            self._pending += 1
        self._jobs.put((job.kind, job.job_id, job))
        return job.job_id

    def take_done(self, timeout_s: float = 0.0) -> list[TierDone]:
        """What finished since the last call (waiting up to ``timeout_s`` for the first when none has)."""
        done = []
        try:
            done.append(self._done.get(timeout=timeout_s) if timeout_s else self._done.get_nowait())
            while True:
                done.append(self._done.get_nowait())
        except queue.Empty:
            pass
        return done

    def wait_idle(self, timeout_s: float) -> bool:
        """Every job submitted so far finished (saves written); False at the timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self) -> None:
        self._jobs.put((-1, 0, None))
        self._thread.join(timeout=10)
        self._readers.shutdown(wait=False)

    def _run(self, job: TierJob) -> None:
        try:
            {LOAD: self._load, PROBE: self._probe, SAVE: self._save}[job.kind](job)
        except Exception:  # (a tier's failure costs its blocks, recomputed, never the engine)
            logger.exception("KV tiers: a job failed; its blocks are recomputed")
            self._done.put(TierDone(job, [""] * len(job.block_ids)))
        finally:
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def _probe(self, job: TierJob) -> None:
        present = self.redis.count_present(job.keys) if self.redis is not None else 0
        self._done.put(TierDone(job, present=present))

    def _load(self, job: TierJob) -> None:
        """Read the job's blocks (several reader threads), each checked: in place on the CPU; else in chunks of at
        most STAGING_BYTES through the staging buffer, then copied into their device blocks."""
        start = time.perf_counter()
        blocks = self.blocks
        if blocks.in_place:
            parts = [blocks.views(block_id) for block_id in job.block_ids]
            sources = list(self._readers.map(self._read_into, job.keys, parts))
        else:
            sources = []
            chunk = max(1, STAGING_BYTES // self.payload_size)
            for first in range(0, len(job.keys), chunk):
                keys = job.keys[first : first + chunk]
                rows = blocks.staging(len(keys))
                parts = [[memoryview(row)] for row in rows.numpy()]
                found = list(self._readers.map(self._read_into, keys, parts))
                loaded = [i for i, source in enumerate(found) if source]
                if loaded:
                    ids = [job.block_ids[first + i] for i in loaded]
                    blocks.scatter(ids, rows if len(loaded) == len(keys) else rows[loaded])
                sources += found
        self._done.put(TierDone(job, sources, seconds=time.perf_counter() - start))
        if self.disk is not None:
            self.disk.touch([key for key, source in zip(job.keys, sources) if source == "disk"])

    def _read_into(self, key: bytes, parts: Parts) -> str:
        """Where the block came from ("disk", "redis"), read into ``parts``; "" when from nowhere."""
        if self.disk is not None and self.disk.read_into(key, parts):
            return "disk"
        if self.redis is not None and self.redis.read_into(key, parts):
            if self.disk is not None:  # (the next read of it is local)
                self.disk.write(key, parts)
            return "redis"
        return ""

    def _save(self, job: TierJob) -> None:
        """Write the job's blocks to each store: from where they live on the CPU (the core holds them until
        this is done), else copied out first (the core gets them back at once)."""
        start = time.perf_counter()
        if job.payloads:
            parts = [[memoryview(payload)] for payload in job.payloads]
            self._done.put(TierDone(job, ["copied"] * len(job.keys)))
        elif self.blocks.in_place:
            parts = [self.blocks.views(block_id) for block_id in job.block_ids]
        else:
            parts = [[memoryview(row)] for row in self.blocks.gather(job.block_ids)]
            self._done.put(
                TierDone(job, ["copied"] * len(job.keys), seconds=time.perf_counter() - start)
            )
        try:
            for key, block in zip(job.keys, parts):
                if self.disk is not None:
                    self.disk.write(key, block)
                if self.redis is not None:
                    self.redis.write(key, block)
        except Exception:  # (the blocks are lost to the tiers, not to the engine)
            logger.exception("KV tiers: writing blocks failed")
        if self.blocks.in_place and not job.payloads:
            self._done.put(
                TierDone(job, ["written"] * len(job.keys), seconds=time.perf_counter() - start)
            )
