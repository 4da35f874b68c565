"""Pinned presets' quotas: a key's own presets share its ``--preset-pin-share-per-key`` of the KV pool, counting
what its other presets already hold; shared presets count only against the pool-wide ``--preset-pin-share``. The
engine computes the cap (engine/core/prefix_pins.py ``pin_cap``); the app names the shares and the key."""

from __future__ import annotations

from engine.core.prefix_pins import pin_cap

POOL = 1000


def cap(num_pinned: int, group_pins: dict[str, int] | None) -> int:
    return pin_cap(POOL, num_pinned, 0.25, group_pins, 0.05)


def test_a_keys_presets_share_its_part_of_the_pin_budget():
    # key t's presets a (30 blocks) and b (10), u's c (40), a shared one (20): 100 pinned in all
    # t's other presets hold 30 of its 50 blocks: b (re-pinned) may take 20 more than what is pinned now
    assert cap(100, {"a": 30}) == 100 + 20
    assert cap(100, {"a": 30, "b": 10}) == 100 + 10  # a new preset d: a and b hold 40 of its 50
    assert cap(100, {}) == 100 + 50  # key v holds nothing yet
    assert cap(100, None) == 250  # a shared preset: the pool-wide cap only


def test_the_pool_wide_cap_still_bounds_a_key():
    assert cap(240, {}) == 250
