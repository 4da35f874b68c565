"""vAttention page accounting on the CPU, driven through a fake CUDA driver (tests/fake_vmm_driver.py) that
enforces the virtual-memory API's rules: random grow / share / copy-on-write / finish sequences keep every live
slot mapped to exactly its blocks, a block sits in two slots only when two live tables share it, and everything
goes back to the driver at the end."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.kv_backend.vattention import VAttentionKV
from tests.fake_vmm_driver import FakeDriver

# bf16: 256 bytes per token per layer -> 8192 tokens per 2 MiB page
LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 64
MAX_MODEL_LEN = 5 * 8192


def make_backend(num_slots: int = 6, num_blocks: int = 24) -> tuple[VAttentionKV, FakeDriver]:
    driver = FakeDriver()
    kv = VAttentionKV(
        driver,
        LAYERS,
        KV_HEADS,
        HEAD_DIM,
        torch.bfloat16,
        torch.device("cpu"),
        MAX_MODEL_LEN,
        num_slots,
    )
    kv.allocate(num_blocks)
    return kv, driver


def handle_of_page(kv: VAttentionKV, driver: FakeDriver, block: int, which: int, layer: int) -> int:
    """From the home range's documented layout: page (layer, block) of K (which=0) or V."""
    return driver.mappings[kv.home[which] + (layer * kv.num_blocks + block) * kv.page_bytes][1]


def slot_mappings(
    kv: VAttentionKV, driver: FakeDriver
) -> dict[tuple[int, int, int, int], tuple[int, int]]:
    """(kv, layer, slot, page) -> (handle, offset) of every mapping inside the slot ranges."""
    found = {}
    per_layer = kv.num_slots * kv.pages_per_slot
    for address, (size, handle, offset) in driver.mappings.items():
        for which, base in enumerate(kv.slots):
            index, rest = divmod(address - base, kv.page_bytes)
            if 0 <= index < LAYERS * per_layer:
                assert rest == 0 and size == kv.page_bytes
                layer, within = divmod(index, per_layer)
                slot, page = divmod(within, kv.pages_per_slot)
                found[(which, layer, slot, page)] = (handle, offset)
    return found


def check(
    kv: VAttentionKV, driver: FakeDriver, live: dict[int, list[int]], idle: bool = True
) -> None:
    """Live slots map exactly their tables' pages (each (kv, layer) page its own handle), the scratch slot its
    page; other slots nothing, except (``idle`` False) released slots whose unmapping is deferred."""
    if idle:
        kv.flush()
    released = kv.released_slots
    kv.wait_background()  # (the fake driver's dicts are not for two threads at once)
    expected = {}
    tables = {**live, kv.scratch_slot: [kv.num_blocks]}
    for slot, table in tables.items():
        for page, block in enumerate(table):
            for which in range(2):
                for layer in range(LAYERS):
                    if block < kv.num_blocks:
                        expected[(which, layer, slot, page)] = (
                            handle_of_page(kv, driver, block, which, layer),
                            0,
                        )
    found = slot_mappings(kv, driver)
    scratch = {key: value for key, value in found.items() if key[2] == kv.scratch_slot}
    assert len(scratch) == 2 * LAYERS and all(key[3] == 0 for key in scratch)
    assert {k: v for k, v in found.items() if k[2] in live} == {
        k: v for k, v in expected.items() if k[2] in live
    }
    stale = {k[2] for k in found if k[2] not in live and k[2] != kv.scratch_slot}
    assert stale <= released and (idle is False or not stale)


def map_all(
    kv: VAttentionKV, rows: list[int], tables: list[list[int]], widths: list[int], wait
) -> None:
    """``map_rows`` for a step that reads or writes every page of each table."""
    kv.map_rows(
        np.array(rows), np.array(tables), np.array(widths), np.array(widths) * kv.block_size, wait
    )


def test_block_maps_into_slot_at_its_page_for_every_layer() -> None:
    kv, driver = make_backend()
    assert (
        kv.block_size == 8192
        and kv.max_len == MAX_MODEL_LEN
        and kv.bytes_per_block == 2 * LAYERS * (2 << 20)
    )
    map_all(kv, [1], [[7, 3, 0, 0, 0]], [2], pytest.fail)
    check(kv, driver, {1: [7, 3]})
    kv.release_row(1)
    check(kv, driver, {})


def test_copy_on_write_waits_for_the_step_in_flight_before_remapping() -> None:
    kv, driver = make_backend()
    map_all(kv, [3, 2], [[5, 6, 0, 0, 0], [5, 6, 0, 0, 0]], [2, 2], pytest.fail)
    waits = []
    map_all(kv, [2], [[5, 9, 0, 0, 0]], [2], lambda: waits.append(1))
    assert waits == [1]
    check(kv, driver, {3: [5, 6], 2: [5, 9]})


def test_random_grow_share_cow_finish_keeps_slots_equal_to_tables() -> None:
    rng = random.Random(0)
    num_blocks, num_slots = 24, 6
    kv, driver = make_backend(num_slots, num_blocks)
    free_blocks, refs = list(range(num_blocks)), [0] * num_blocks
    live: dict[int, list[int]] = {}
    free_slots = [slot for slot in range(kv.num_slots) if slot != kv.scratch_slot]
    reused_deferred = 0  # new requests given a free slot whose pages were still mapped

    def take() -> int:
        block = free_blocks.pop(rng.randrange(len(free_blocks)))
        refs[block] += 1
        return block

    for _ in range(400):
        op = rng.random()
        if op < 0.3 and free_slots and free_blocks:
            slot = free_slots.pop(rng.randrange(len(free_slots)))
            reused_deferred += slot in kv.released_slots
            kv.claim_slot(slot)
            shared = (
                rng.choice(list(live.values()))[: rng.randrange(3)]
                if live and rng.random() < 0.5
                else []
            )
            for block in shared:
                refs[block] += 1
            live[slot] = shared + [take()]
        elif op < 0.6 and live and free_blocks:
            table = live[rng.choice(list(live))]
            if len(table) < kv.pages_per_slot:
                table.append(take())
        elif op < 0.75 and live and free_blocks:  # copy-on-write of a shared page
            table = live[rng.choice(list(live))]
            index = rng.randrange(len(table))
            if refs[table[index]] > 1:
                refs[table[index]] -= 1
                table[index] = take()
        elif live:
            slot = rng.choice(list(live))
            for block in live.pop(slot):
                refs[block] -= 1
                if refs[block] == 0:
                    free_blocks.append(block)
            kv.release_row(slot)
            free_slots.append(slot)
        rows = np.array(sorted(live), dtype=np.int64)
        tables = np.zeros((len(rows), kv.pages_per_slot), dtype=np.int64)
        for i, slot in enumerate(rows.tolist()):
            tables[i, : len(live[slot])] = live[slot]
        widths = np.array([len(live[s]) for s in rows.tolist()], dtype=np.int64)
        # some sequences still decode in their next-to-last page: their last one is mapped in the background
        ahead = np.array([rng.random() < 0.3 for _ in rows.tolist()], dtype=np.int64) * (widths > 1)
        kv.map_rows(rows, tables, widths, (widths - ahead) * kv.block_size, lambda: None)
        check(kv, driver, live, idle=False)
    assert reused_deferred > 0
    for slot in list(live):
        kv.release_row(slot)
    check(kv, driver, {})
    kv.free()
    assert driver.mappings == {} and driver.handles == {} and driver.reserved == {}
    assert driver.map_calls == driver.unmap_calls


def test_a_token_that_does_not_divide_the_page_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_backend"):
        VAttentionKV(FakeDriver(), LAYERS, 3, 100, torch.bfloat16, torch.device("cpu"), 4096, 4)


def test_vattention_on_the_cpu_is_a_clear_config_error() -> None:
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="kv_backend: vattention needs a CUDA device"):
        EngineConfig(device="cpu", kv_backend="vattention").resolve()


def test_a_request_whose_first_block_a_free_slot_maps_takes_that_slot_and_maps_nothing() -> None:
    """Eager allocation (the pool's first blocks premapped at start) and deferred reclamation (a finished
    request's pages left mapped) both spare the driver on admission."""
    kv, driver = make_backend()
    slot = kv.choose_slot(0)  # block 0: the first a new pool hands out
    assert slot is not None and slot != kv.scratch_slot
    calls = driver.map_calls
    kv.claim_slot(slot)
    map_all(kv, [slot], [[0, 0, 0, 0, 0]], [1], pytest.fail)
    assert driver.map_calls == calls
    map_all(kv, [slot], [[0, 11, 0, 0, 0]], [2], pytest.fail)  # grows a page
    assert driver.map_calls == calls + 2 * LAYERS
    kv.release_row(slot)
    assert kv.choose_slot(0) == slot and kv.choose_slot(11) is None  # (indexed by page 0 only)
    other = kv.choose_slot(1)
    # a new request in a slot that mapped block 1: its page 0 now holds block 0 instead
    kv.claim_slot(other)
    map_all(kv, [other], [[0, 0, 0, 0, 0]], [1], pytest.fail)
    assert driver.unmap_calls == 2 * LAYERS and kv.choose_slot(0) == slot
    check(kv, driver, {other: [0]}, idle=False)
    check(kv, driver, {other: [0]})


def test_a_page_given_ahead_of_need_is_mapped_in_the_background_and_not_again() -> None:
    kv, driver = make_backend()
    kv.map_rows(
        np.array([2]), np.array([[7, 9, 0, 0, 0]]), np.array([2]), np.array([10]), pytest.fail
    )
    kv.wait_background()
    check(kv, driver, {2: [7, 9]}, idle=False)
    calls = driver.map_calls
    kv.map_rows(
        np.array([2]),
        np.array([[7, 9, 0, 0, 0]]),
        np.array([2]),
        np.array([kv.block_size + 1]),
        pytest.fail,
    )  # the sequence reaches page 1: already mapped
    assert driver.map_calls == calls


def test_a_backend_collected_as_garbage_gives_everything_back_without_waiting_on_its_worker() -> (
    None
):
    """SlotPages refers back to its backend, so a dropped backend is collected by the cycle collector, with
    its executor; the worker is told to exit before the finalizer runs. A finalizer that queued the deferred
    unmapping to that worker and waited for it hung the whole test run (CI, 2026-11-24)."""
    import gc
    import threading

    kv, driver = make_backend()
    map_all(kv, [1, 2], [[7, 3, 0, 0, 0], [4, 0, 0, 0, 0]], [2, 1], pytest.fail)
    kv.release_row(1)  # deferred: still mapped
    kv.map_rows(
        np.array([2]), np.array([[4, 9, 0, 0, 0]]), np.array([2]), np.array([10]), pytest.fail
    )
    kv.wait_background()
    assert kv.released_slots and driver.mappings
    del kv
    collector = threading.Thread(target=gc.collect, daemon=True)
    collector.start()
    collector.join(timeout=30)
    assert not collector.is_alive(), "collecting the backend waits forever"
    assert driver.mappings == {} and driver.handles == {} and driver.reserved == {}
    assert driver.map_calls == driver.unmap_calls
