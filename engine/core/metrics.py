"""Engine counters and the EngineStats snapshot (no HTTP here: the app exports them)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (annotations only)
    from engine.core.block_stats import BlockStats
    from engine.core.scheduler import Scheduler
    from engine.core.tier_blocks import TierBlocks


@dataclass(slots=True)
class EngineCounters:
    """Monotonic counters the engine thread updates after each step."""

    prompt_tokens: int = 0  # prompt tokens of admitted requests (cached ones included)
    generation_tokens: int = 0
    steps: int = 0
    finished: Counter = field(default_factory=Counter)  # finish reason -> requests
    # host time of the engine thread per phase, cumulative seconds (benchmarks read the per-step split)
    schedule_seconds: float = 0.0  # scheduler.schedule()
    prepare_seconds: float = 0.0  # building and copying the step's input tensors
    # launching the forward pass and sampling (eager kernels or a graph replay)
    launch_seconds: float = 0.0
    wait_seconds: float = 0.0  # blocked on the device for the sampled tokens
    # appending tokens, stop checks, detokenizing, building RequestOutputs
    output_seconds: float = 0.0
    # speculative decoding (engine/speculative/): sequences verified (a step's drafted row group each), draft
    # tokens verified, and of those the ones kept
    spec_verifications: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass(slots=True, frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # share of KV blocks referenced by a sequence
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_pinned_blocks: int  # held for shared system prompts (not evictable)
    prefix_queries: int  # tokens looked up in the prefix cache
    prefix_hits: int  # tokens found (on the device or in the host tier)
    prefix_host_hits: int  # of those, tokens copied back from the host tier
    num_host_cached_blocks: int  # blocks in the host tier of the prefix cache
    host_cache_stores: int  # evicted cached blocks copied to the host tier
    evictions: int  # cached blocks reused for other tokens
    preemptions: int
    kv_allocated_slots: int
    kv_used_slots: int
    prompt_tokens: int
    generation_tokens: int
    steps: int
    finished: dict[str, int]
    num_swapped: int = 0  # sequences swapped out to host memory, waiting to come back
    # tokens computed in prefill chunks (prompts, recomputes): the prompt tok/s the engine achieves
    prefill_tokens: int = 0
    # the lower KV tiers (engine/kv_tiers/): tokens of prefix hits read back from disk and from Redis, blocks on
    # disk now, bytes read and written, seconds spent reading blocks back (cumulative), blocks found corrupt or
    # unreadable (recomputed instead)
    prefix_disk_hits: int = 0
    prefix_redis_hits: int = 0
    num_disk_blocks: int = 0
    kv_tier_read_bytes: int = 0
    kv_tier_written_bytes: int = 0
    kv_tier_restore_seconds: float = 0.0
    kv_tier_rejected_blocks: int = 0
    # speculative decoding: EngineCounters'
    spec_verifications: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @classmethod
    def collect(
        cls, blocks: BlockStats, scheduler: Scheduler, counters: EngineCounters
    ) -> EngineStats:
        """The snapshot of a core's block manager, scheduler and counters."""
        return cls(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_usage=blocks.usage,
            num_blocks=blocks.num_blocks,
            num_free_blocks=blocks.num_free_blocks,
            num_cached_blocks=blocks.num_cached_blocks,
            num_pinned_blocks=blocks.num_pinned_blocks,
            prefix_queries=blocks.prefix_queries,
            prefix_hits=blocks.prefix_hits,
            prefix_host_hits=blocks.prefix_host_hits,
            num_host_cached_blocks=blocks.num_host_cached_blocks,
            host_cache_stores=blocks.host_cache_stores,
            evictions=blocks.evictions,
            preemptions=scheduler.num_preemptions,
            kv_allocated_slots=blocks.allocated_slots,
            kv_used_slots=blocks.used_slots,
            prompt_tokens=counters.prompt_tokens,
            generation_tokens=counters.generation_tokens,
            steps=counters.steps,
            finished=dict(counters.finished),
            num_swapped=len(scheduler.swapped),
            prefill_tokens=scheduler.num_prefill_tokens,
            spec_verifications=counters.spec_verifications,
            spec_draft_tokens=counters.spec_draft_tokens,
            spec_accepted_tokens=counters.spec_accepted_tokens,
            **tier_stats(scheduler.tiers, scheduler.block_manager.block_size),
        )

    @property
    def prefix_device_hits(self) -> int:
        return self.prefix_hits - self.prefix_host_hits

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def kv_waste(self) -> float:
        """Share of allocated KV slots not holding a token."""
        if not self.kv_allocated_slots:
            return 0.0
        return 1.0 - self.kv_used_slots / self.kv_allocated_slots


def tier_stats(tiers: TierBlocks | None, block_size: int) -> dict[str, int | float]:
    """EngineStats' fields of the KV tiers below the host (none when they are off)."""
    if tiers is None:
        return {}
    stores = [store for store in (tiers.io.disk, tiers.io.redis) if store is not None]
    return {
        "prefix_disk_hits": tiers.counts.disk_hits * block_size,
        "prefix_redis_hits": tiers.counts.redis_hits * block_size,
        "num_disk_blocks": len(tiers.io.disk) if tiers.io.disk is not None else 0,
        "kv_tier_read_bytes": sum(store.counts.bytes_read for store in stores),
        "kv_tier_written_bytes": sum(store.counts.bytes_written for store in stores),
        "kv_tier_restore_seconds": tiers.counts.restore_seconds,
        "kv_tier_rejected_blocks": sum(store.counts.rejected for store in stores),
    }
