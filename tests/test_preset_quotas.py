"""A key's own presets pin at most its share of the KV pool (``--preset-pin-share-per-key``), whatever its other
presets already hold; shared presets count only against the pool-wide ``--preset-pin-share``."""
from __future__ import annotations

from types import SimpleNamespace

from app.sessions.presets import _pin_cap
from app.sessions.store import Preset


def server_with(num_pinned: int) -> SimpleNamespace:
    stats = SimpleNamespace(num_blocks=1000, num_pinned_blocks=num_pinned)
    settings = SimpleNamespace(preset_pin_share=0.25, preset_pin_share_per_key=0.05)
    return SimpleNamespace(settings=settings, engine=SimpleNamespace(stats=lambda: stats))


def test_a_keys_presets_share_its_part_of_the_pin_budget():
    pins = {"preset:t/a": (300, 30), "preset:t/b": (100, 10), "preset:u/c": (500, 40), "preset:shared": (90, 20)}
    server = server_with(num_pinned=100)
    # t's other presets hold 30 of its 50 blocks: b (re-pinned) may take 20 more than what is pinned now
    assert _pin_cap(server, Preset("b", "", owner="t"), pins) == 100 + 20
    assert _pin_cap(server, Preset("d", "", owner="t"), pins) == 100 + 10  # a and b hold 40 of its 50
    assert _pin_cap(server, Preset("e", "", owner="v"), pins) == 100 + 50  # v holds nothing yet
    assert _pin_cap(server, Preset("shared", ""), pins) == 250  # the pool-wide cap only


def test_the_pool_wide_cap_still_bounds_a_key():
    pins = {}
    assert _pin_cap(server_with(num_pinned=240), Preset("x", "", owner="t"), pins) == 250
