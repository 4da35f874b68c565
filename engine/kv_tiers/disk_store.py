"""The disk tier: each block a file named by its tier key, in a directory bounded in bytes, least recently used
first out.

A block is written to a temporary name and renamed into place (a crash leaves a stray temporary, never a torn block
under its name); a file that still fails its check when read (a disk error, a power loss before the data reached
the disk) is deleted and counted, and the block is recomputed. The index (key -> size, least recently used first) is
rebuilt at start from the directory, ordered by modification time, which a read refreshes: the order survives a
restart. Several models share one directory and its bound: a key holds its model's fingerprint.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from engine.kv_tiers.block_file import HEADER, CorruptBlock, Parts, check, header, payload_size

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
PARTIAL = ".partial"


@dataclass(slots=True)
class StoreCounts:
    """What a store did, cumulative."""

    blocks_written: int = 0
    bytes_written: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    rejected: int = 0  # found corrupt (deleted) or unreadable: recomputed
    write_failures: int = 0  # not written (disk full, an I/O error)


class DiskStore:
    def __init__(self, root: Path, capacity_bytes: int) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.counts = StoreCounts()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recent first
        self._size = 0
        root.mkdir(parents=True, exist_ok=True)
        self._scan()

    def __len__(self) -> int:
        return len(self._index)

    @property
    def size_bytes(self) -> int:
        return self._size

    def contains(self, key: bytes) -> bool:
        return key in self._index

    def path_of(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / (name + SUFFIX)

    def write(self, key: bytes, parts: Parts) -> bool:
        """Store a block (False when it could not be: the disk is full, an I/O error; nothing half-written
        stays). A block already stored only becomes the most recent."""
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
        path = self.path_of(key)
        partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}{PARTIAL}")
        buffers = [header(key, parts), *parts]
        size = sum(memoryview(b).nbytes for b in buffers)
        try:
            path.parent.mkdir(exist_ok=True)
            with open(partial, "wb", buffering=0) as file:
                if _write_all(file.fileno(), buffers) != size:
                    raise OSError(errno.EIO, "short write")
            os.replace(partial, path)
        except OSError as exc:
            partial.unlink(missing_ok=True)
            self.counts.write_failures += 1
            if self.counts.write_failures == 1 or exc.errno != errno.ENOSPC:
                logger.warning("KV disk tier: block not written to %s: %s", self.root, exc)
            return False
        with self._lock:
            self._add(key, size)
            self.counts.blocks_written += 1
            self.counts.bytes_written += size
            evicted = self._evict()
        for old in evicted:
            self.path_of(old).unlink(missing_ok=True)
        return True

    def read_into(self, key: bytes, parts: Parts) -> bool:
        """Read a stored block's payload into ``parts`` and check it; False when it is not here or fails its
        check (then it is gone, and ``parts`` hold nothing of use)."""
        if key not in self._index:
            return False
        path = self.path_of(key)
        head = bytearray(HEADER.size)
        try:
            with open(path, "rb", buffering=0) as file:
                size = os.readv(file.fileno(), [head, *parts])
                if size != HEADER.size + payload_size(parts) or file.read(1):
                    raise CorruptBlock("not the size of this block")
            check(head, parts, key)
        except (OSError, CorruptBlock) as exc:
            self._drop(key)
            if not isinstance(exc, FileNotFoundError):
                self.counts.rejected += 1
                logger.warning("KV disk tier: block %s refused (%s): recomputed", path.name, exc)
                path.unlink(missing_ok=True)
            return False
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        self.counts.blocks_read += 1
        self.counts.bytes_read += size
        return True

    def touch(self, keys: list[bytes]) -> None:
        """Mark blocks read as used now on disk too (their modification time: the order after a restart); out
        of a load's way, once its blocks are in."""
        for key in keys:
            with contextlib.suppress(OSError):
                os.utime(self.path_of(key))

    def _drop(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._size -= size

    def _add(self, key: bytes, size: int) -> None:
        if key in self._index:
            self._size -= self._index[key]
        self._index[key] = size
        self._size += size

    def _evict(self) -> list[bytes]:
        """Keys over the bound, least recent first, out of the index (their files are deleted by the caller)."""
        evicted = []
        while self._size > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._size -= size
            evicted.append(key)
        return evicted

    def _scan(self) -> None:
        """The index from the directory: blocks by last use, stray partial files deleted, the bound applied."""
        found = []
        for path in self.root.glob("??/*"):
            try:
                if path.name.endswith(PARTIAL):
                    path.unlink(missing_ok=True)
                elif path.name.endswith(SUFFIX):
                    stat = path.stat()
                    found.append(
                        (stat.st_mtime_ns, bytes.fromhex(path.name[: -len(SUFFIX)]), stat.st_size)
                    )
            except (OSError, ValueError):
                continue  # (a file that is not ours, or vanished meanwhile)
        for _, key, size in sorted(found):
            self._add(key, size)
        for old in self._evict():
            self.path_of(old).unlink(missing_ok=True)
        if self._index:
            logger.info(
                "KV disk tier: %d blocks (%.1f MiB) in %s",
                len(self._index),
                self._size / 2**20,
                self.root,
            )


def _write_all(fd: int, buffers: list) -> int:
    """``os.writev`` until every byte is written (it may write less than asked); the bytes written."""
    views = [memoryview(b).cast("B") for b in buffers]
    written = 0
    while views:
        n = os.writev(fd, views)
        if n == 0:
            break
        written += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return written
