"""The CPU KV pool's memory (engine/kv_backend/paged.py ``host_zeros``): zero, resident only as its blocks are
written, told apart by name in /proc/PID/smaps, and unmapped with its last view."""

from __future__ import annotations

import gc
import os

import torch

from benchmarks.harness.processes import kv_pool_resident
from engine.kv_backend.paged import PagedKV, host_zeros

MIB = 2**20


def test_the_pool_is_zero_and_resident_only_where_written():
    before = kv_pool_resident(os.getpid())
    pool = host_zeros((4, 1024, 16, 8, 64), torch.float32)  # 128 MiB (blocks of 32 KiB)
    assert pool.shape == (4, 1024, 16, 8, 64) and pool.dtype == torch.float32
    assert pool.is_contiguous() and pool.data_ptr() % 4096 == 0
    assert kv_pool_resident(os.getpid()) - before < MIB
    pool[1, :128].fill_(1.5)  # 4 MiB of blocks written
    resident = kv_pool_resident(os.getpid()) - before
    assert 4 * MIB <= resident < 5 * MIB, resident
    # (zero elsewhere)
    assert float(pool.sum()) == 1.5 * 128 * 16 * 8 * 64
    view = pool[1, 3]
    del pool
    gc.collect()
    assert float(view.sum()) == 1.5 * 16 * 8 * 64  # (a view keeps the mapping)
    del view
    gc.collect()
    assert kv_pool_resident(os.getpid()) - before < MIB


def test_paged_kv_on_the_cpu_allocates_mapped_zeros_of_its_dtype():
    kv = PagedKV(2, 2, 16, torch.float8_e4m3fn, torch.device("cpu"), 16)
    kv.allocate(8)
    k, v = kv.layer_caches(1)
    assert k.shape == (8, 16, 2, 16) and k.dtype == torch.float8_e4m3fn
    assert float(k.float().abs().sum()) == 0.0 and float(v.float().abs().sum()) == 0.0
    k[0, 0] = 2.0
    assert float(kv.layer_caches(1)[0][0, 0].float().sum()) == 2.0 * 2 * 16
    assert float(v.float().abs().sum()) == 0.0  # (K and V apart)
    kv.free()
