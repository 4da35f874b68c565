"""Redis as a KV tier: the disk tier's stored blocks (block_file.py) as Redis values, shared by the replicas of a
deployment and kept across their restarts. Bounded by Redis itself (give its instance a ``maxmemory`` and an LRU
policy: docker/compose.yml) and by a time to live; every call has a timeout, and a Redis that fails or is gone
costs the blocks it held (they are recomputed), never the request."""

from __future__ import annotations

import logging
import time

import redis

from engine.kv_tiers.block_file import CorruptBlock, Parts, decode_into, encode
from engine.kv_tiers.disk_store import StoreCounts

logger = logging.getLogger(__name__)

PREFIX = b"pagedchat:kv:"
TTL_S = 7 * 86400
TIMEOUT_S = 2.0
RETRY_AFTER_S = 5.0  # after a failure, the tier is skipped for this long


class RedisStore:
    def __init__(self, url: str) -> None:
        self.url = url
        self.client = redis.Redis.from_url(
            url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S
        )
        self.counts = StoreCounts()
        self._down_until = 0.0

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def write(self, key: bytes, parts: Parts) -> bool:
        if not self.available:
            return False
        data = encode(key, parts)
        try:
            self.client.set(PREFIX + key, data, ex=TTL_S)
        except redis.RedisError as exc:
            self._failed("write", exc)
            self.counts.write_failures += 1
            return False
        self.counts.blocks_written += 1
        self.counts.bytes_written += len(data)
        return True

    def count_present(self, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, are stored (one round trip)."""
        if not keys or not self.available:
            return 0
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.exists(PREFIX + key)
                present = pipe.execute()
        except redis.RedisError as exc:
            self._failed("lookup", exc)
            return 0
        count = 0
        while count < len(keys) and present[count]:
            count += 1
        return count

    def read_into(self, key: bytes, parts: Parts) -> bool:
        """A stored block's payload into ``parts``, checked; False when absent, refused or unreachable."""
        if not self.available:
            return False
        try:
            data = self.client.get(PREFIX + key)
        except redis.RedisError as exc:
            self._failed("read", exc)
            return False
        if data is None:
            return False
        try:
            decode_into(data, parts, key)
        except CorruptBlock as exc:
            self.counts.rejected += 1
            logger.warning("KV Redis tier: block refused (%s): recomputed", exc)
            return False
        self.counts.blocks_read += 1
        self.counts.bytes_read += len(data)
        return True

    def _failed(self, what: str, exc: Exception) -> None:
        if self.available:
            logger.warning(
                "KV Redis tier (%s): %s failed: %s; skipped for %.0f s",
                self.url,
                what,
                exc,
                RETRY_AFTER_S,
            )
        self._down_until = time.monotonic() + RETRY_AFTER_S
