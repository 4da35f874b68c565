"""The typed contracts between parts: the KV backends implement KVBackend (engine/kv_backend/base.py) in full,
the paged one keeps block-addressed caches of the documented shape, and AsyncEngine has every member of the
EngineClient the server is written against (engine/engine_client.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kv_backend import KVBackend, LeanCpuPagedKV, PagedKV, VAttentionKV, make_kv_backend
from engine.worker.dummy_model import dummy_hf_config
from engine.models.llama_args import LlamaArgs
from tests.fake_vmm_driver import FakeDriver


@pytest.mark.parametrize("backend", [PagedKV, LeanCpuPagedKV, VAttentionKV])
def test_each_backend_implements_the_whole_contract(backend: type):
    assert issubclass(backend, KVBackend)
    # (an unimplemented member would fail only where it is built)
    assert not backend.__abstractmethods__


def test_the_paged_backend_keeps_block_addressed_caches():
    args = LlamaArgs.from_hf(dummy_hf_config("qwen3-0.6b"))
    kv = make_kv_backend("paged", args, torch.float32, torch.device("cpu"), 16, 1024, 8)
    kv.allocate(5)
    assert kv.k_caches.shape == (args.num_layers, 5, 16, args.num_kv_heads, args.head_dim)
    assert kv.bytes_per_block == 2 * args.num_layers * 16 * args.num_kv_heads * args.head_dim * 4
    k, v = kv.layer_caches(3)
    assert k.data_ptr() == kv.k_caches[3].data_ptr() and not v.any()
    kv.free()
    assert kv.k_caches.numel() == 0


def test_the_cpu_gets_the_lean_paged_backend_with_the_default_kernels_and_the_plain_one_otherwise(
    monkeypatch,
):
    import kernels

    args = LlamaArgs.from_hf(dummy_hf_config("qwen3-0.6b"))
    assert (
        type(make_kv_backend("paged", args, torch.float32, torch.device("cpu"), 16, 1024, 8))
        is LeanCpuPagedKV
    )
    monkeypatch.setattr(kernels, "_CHOICE", "reference")
    assert (
        type(make_kv_backend("paged", args, torch.float32, torch.device("cpu"), 16, 1024, 8))
        is PagedKV
    )


def test_the_paged_backend_addresses_a_token_by_its_block_and_packs_each_block_table_row():
    kv = PagedKV(1, 1, 1, torch.float32, torch.device("cpu"), 4)
    # the step inputs' rows: one per live sequence
    table = np.array([[7, 2, 0], [5, 9, 3]], dtype=np.int32)
    token_rows, positions = np.array([1, 1, 0, 1]), np.array([0, 5, 6, 11])
    assert kv.slot_mapping(table, token_rows, positions).tolist() == [
        5 * 4,
        9 * 4 + 1,
        2 * 4 + 2,
        3 * 4 + 3,
    ]
    assert kv.table_shape(2, 8, 3) == (2, 3)  # (graph padding rows need no table row)
    out = np.full((2, 2), -1, dtype=np.int32)
    kv.pack_tables(out, table, np.array([1, 0]))
    assert out.tolist() == [[5, 9], [7, 2]]
    assert kv.slot_ids(torch.tensor(out)) is None and kv.reserved_row is None


def test_the_contiguous_backend_addresses_a_token_in_its_request_slot_and_packs_slot_ids():
    kv = VAttentionKV(FakeDriver(), 2, 4, 128, torch.bfloat16, torch.device("cpu"), 8192, 4)
    # (block ids do not address a contiguous slot)
    table = np.array([[7, 2], [5, 9], [4, 4]], dtype=np.int32)
    token_rows, positions = np.array([2, 2, 1]), np.array([0, 300, 9])
    assert kv.slot_mapping(table, token_rows, positions).tolist() == [
        2 * kv.max_len,
        2 * kv.max_len + 300,
        kv.max_len + 9,
    ]
    assert kv.table_shape(2, 4, 7) == (4, 1)  # padding rows read the scratch slot
    out = np.full((4, 1), -1, dtype=np.int32)
    kv.pack_tables(out, table, np.array([2, 1]))
    assert out[:, 0].tolist() == [2, 1, kv.scratch_slot, kv.scratch_slot]
    assert kv.slot_ids(torch.tensor(out)).tolist() == [2, 1, kv.scratch_slot, kv.scratch_slot]
    assert kv.reserved_row == kv.scratch_slot


def test_the_async_engine_is_the_engine_client_the_server_is_written_against():
    from engine.async_engine import AsyncEngine
    from engine.engine_client import EngineClient

    members = [name for name in vars(EngineClient) if not name.startswith("_")]
    missing = [name for name in members if not hasattr(AsyncEngine, name)]
    assert not missing
    # (set in __init__)
    assert set(EngineClient.__annotations__) <= set(AsyncEngine.__init__.__code__.co_names)
