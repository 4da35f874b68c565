"""Pinned prefixes: the cached blocks of a prompt prefix (a preset's system prompt) held against eviction.

A pin is all or none of the prefix's full blocks, computed by an earlier request. Pins are capped: all pins
together hold at most ``share`` of the KV pool, and the pins of one group (an API key's presets) at most
``group_share`` of it, so no key's presets crowd out the cache everyone shares. The block manager keeps the
pinned blocks; this book keeps what each pin asked for (its tokens and group), so ``pins()`` also shows pins
that hold no block now (over the cap, or released to make room: the scheduler drops pins before it preempts).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from engine.core.block_manager import BlockManager
from engine.sequence import Sequence
from engine.sampling_params import SamplingParams


class PrefixPins:
    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self._tokens: dict[str, int] = {}  # pin id -> tokens of its prefix
        self._groups: dict[str, str | None] = {}  # pin id -> its group (whose pins share a cap)

    def pin(
        self,
        pin_id: str,
        token_ids: SequenceOf[int],
        cache_salt: str | None,
        share: float = 1.0,
        group: str | None = None,
        group_share: float = 1.0,
    ) -> int:
        """Pin the cached full blocks of ``token_ids`` against eviction, all or none; returns how many were
        pinned (0 when caching is off, they were evicted, or over the cap)."""
        probe = Sequence(
            seq_id=-1,
            request_id=pin_id,
            token_ids=list(token_ids),
            params=SamplingParams(),
            cache_salt=cache_salt,
        )
        blocks = self.block_manager
        blocks.update_block_hashes(probe)
        self._tokens[pin_id] = len(probe.token_ids)
        self._groups[pin_id] = group
        group_pins = {
            other: len(held)
            for other, held in blocks.pins.items()
            if other != pin_id and group is not None and self._groups.get(other) == group
        }
        cap = pin_cap(
            blocks.num_blocks,
            blocks.num_pinned_blocks,
            share,
            group_pins if group else None,
            group_share,
        )
        return blocks.pin(pin_id, probe.block_hashes, cap)

    def unpin(self, pin_id: str) -> None:
        self._tokens.pop(pin_id, None)
        self._groups.pop(pin_id, None)
        self.block_manager.unpin(pin_id)

    def pins(self) -> dict[str, tuple[int, int]]:
        """Every pin asked for and not unpinned: pin id -> (its tokens, blocks pinned now)."""
        held = self.block_manager.pins
        return {
            pin_id: (tokens, len(held.get(pin_id, ()))) for pin_id, tokens in self._tokens.items()
        }


def pin_cap(
    num_blocks: int,
    num_pinned: int,
    share: float,
    group_pins: dict[str, int] | None,
    group_share: float,
) -> int:
    """The cap ``BlockManager.pin`` holds all pins to (``num_pinned + new <= cap``) for a new pin: ``share`` of
    the pool, and for a pin of a group (an API key's presets) also what the group's other pins (``group_pins``:
    pin id -> blocks) left of its ``group_share``."""
    cap = int(share * num_blocks)
    if group_pins is None:
        return cap
    room = int(group_share * num_blocks) - sum(group_pins.values())
    return min(cap, num_pinned + max(room, 0))
