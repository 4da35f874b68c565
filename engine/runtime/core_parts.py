"""The engine core's books, built from its configuration and its model runner: the block manager (with the host
tier and the sliding-window layers' blocks), the scheduler (with its swap policy) and the KV tiers below the host."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as SequenceOf

import torch

from engine.config import EngineConfig
from engine.core.block_hash import BlockHasher
from engine.core.block_manager import BlockManager
from engine.core.preemption import SwapPolicy
from engine.core.scheduler import Scheduler
from engine.core.tier_blocks import TierBlocks
from engine.core.window_blocks import WindowBlocks
from engine.kv_tiers.disk_store import DiskStore
from engine.kv_tiers.fingerprint import files_identity, fingerprint
from engine.kv_tiers.tier_io import BlockBytes, TierIO
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.worker.model_runner import ModelRunner
from kernels.cpu_native import resolve_isa

logger = logging.getLogger(__name__)


def new_block_manager(
    config: EngineConfig, runner: ModelRunner, num_blocks: int, window_blocks: int
) -> BlockManager:
    return BlockManager(
        num_blocks,
        config.block_size,
        config.enable_prefix_caching,
        BlockHasher(config.prefix_hash, config.model_id, config.prefix_cache_seed),
        *runner.allocate_host_pools(),
        runner.kv.lookahead_tokens,
        config.max_blocks_per_seq,
        WindowBlocks.of(window_blocks, config, runner.kv.window),
    )


def new_scheduler(
    config: EngineConfig, runner: ModelRunner, block_manager: BlockManager
) -> Scheduler:
    swap = SwapPolicy(
        config.preemption_mode,
        config.torch_device.type,
        runner.bytes_per_block,
        runner.num_parameters,
    )
    scheduler = Scheduler(
        block_manager,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        prefer_swap=swap,
        max_seqs_per_tenant=config.max_seqs_per_tenant,
        shared_step_time_factor=config.shared_step_time_factor,
        step_time_target_s=config.step_time_target_s,
    )
    scheduler.tiers = open_kv_tiers(config, runner, block_manager)
    return scheduler


def open_kv_tiers(
    config: EngineConfig, runner: ModelRunner, block_manager: BlockManager
) -> TierBlocks | None:
    """The disk tier (``kv_disk_size`` > 0) and the Redis tier (``kv_redis_url``), or None: off, or not for this
    engine (no prefix caching; a model with sliding-window layers, tensor parallelism or the vattention backend,
    whose blocks the tiers do not move yet)."""
    if not config.kv_disk_size and not config.kv_redis_url:
        return None
    unsupported = (
        "prefix caching is off"
        if not config.enable_prefix_caching
        else "the model has sliding-window layers"
        if runner.kv.window
        else "tensor parallelism shards the KV"
        if config.tensor_parallel_size > 1
        else "the vattention backend"
        if config.kv_backend != "paged"
        else None
    )
    if unsupported is not None:
        logger.info("KV tiers below the host are off: %s", unsupported)
        return None
    disk = DiskStore(config.kv_disk_dir, config.kv_disk_size) if config.kv_disk_size else None
    redis = None
    if config.kv_redis_url:
        from engine.kv_tiers.redis_store import (
            RedisStore,
        )  # (the redis client only where it is used)

        redis = RedisStore(config.kv_redis_url)
    kv = runner.kv
    host = (
        BlockBytes(runner.host_k_caches, runner.host_v_caches)
        if block_manager.host_cache is not None
        else None
    )
    device = BlockBytes(kv.k_caches, kv.v_caches)
    io = TierIO(device, disk, redis, num_readers=_readers(config), host=host)
    return TierBlocks(
        block_manager.pool, block_manager.host_cache, io, engine_fingerprint(config, kv.k_caches)
    )


def engine_fingerprint(config: EngineConfig, k_caches: torch.Tensor) -> bytes:
    """What shapes a block's bytes besides its tokens (engine/kv_tiers/fingerprint.py)."""
    cpu = config.torch_device.type == "cpu"
    return fingerprint(
        {
            "weights": ("dummy", config.model_config, config.seed)
            if config.load_format == "dummy"
            else files_identity(config.model_path),
            "model_id": config.model_id,
            "dtype": str(config.torch_dtype),
            "kv_dtype": str(k_caches.dtype),
            "block_size": config.block_size,
            "kv_block_shape": (k_caches.shape[0], *k_caches.shape[2:]),
            "cpu_weights": config.cpu_weights if cpu else "",
            "cpu_isa": resolve_isa(config.cpu_isa) if cpu else "",
            "device": config.torch_device.type,
            "torch": torch.__version__,
        }
    )


def _readers(config: EngineConfig) -> int:
    """Threads that read blocks back: enough to keep a GPU's copy busy, few where they share the CPU."""
    return 8 if config.torch_device.type == "cuda" else 2


def warm_prefix(scheduler: Scheduler, token_ids: SequenceOf[int], cache_salt: str | None) -> int:
    """Start bringing the blocks of ``token_ids`` back from the lower tiers; the number on their way."""
    if scheduler.tiers is None:
        return 0
    probe = Sequence(-1, "warm", list(token_ids), SamplingParams(), cache_salt)
    scheduler.block_manager.update_block_hashes(probe)
    return scheduler.tiers.fetch(probe.block_hashes, len(probe.block_hashes))


def flush_kv_tiers(tiers: TierBlocks | None, timeout_s: float) -> bool:
    """Wait until every block handed to the lower tiers is written and settled; False at the timeout."""
    deadline = time.monotonic() + timeout_s
    while tiers is not None and tiers.busy and time.monotonic() < deadline:
        tiers.poll(timeout_s=0.05)
    return tiers is None or (not tiers.busy and tiers.io.wait_idle(deadline - time.monotonic()))
