"""The prefix cache's handles on an engine core, for the front: pin a prefix (a preset's system prompt) against
eviction, unpin it, list the pins, and warm a prefix (bring its blocks back from the lower KV tiers before the
request that needs them). AsyncEngine (async_engine.py) has them; they run in the core between steps
(EngineCore's methods of the same names)."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from collections.abc import Sequence as SequenceOf
from typing import Any

from engine.request_stream import RequestStream
from engine.sampling_params import SamplingParams


class PrefixCacheCalls:
    """What an engine front provides for these handles: ``generate`` and ``call`` (AsyncEngine's)."""

    generate: Callable[..., RequestStream]
    # call(target, *args): an EngineCore method by name, run in the core between steps
    call: Callable[..., Awaitable[Any]]

    async def pin_prefix(
        self,
        pin_id: str,
        token_ids: SequenceOf[int],
        cache_salt: str | None = None,
        share: float = 1.0,
        group: str | None = None,
        group_share: float = 1.0,
    ) -> int:
        """Compute ``token_ids`` once (a one-token request) and pin their full blocks against eviction; the number
        of blocks pinned (caps: EngineCore.pin_prefix)."""
        params = SamplingParams(temperature=0.0, max_tokens=1)
        async for _ in self.generate(
            token_ids,
            params,
            request_id=f"pin-{pin_id}-{uuid.uuid4().hex[:8]}",
            cache_salt=cache_salt,
        ):
            pass
        return await self.call(
            "pin_prefix", pin_id, list(token_ids), cache_salt, share, group, group_share
        )

    async def warm_prefix(self, token_ids: SequenceOf[int], cache_salt: str | None = None) -> int:
        """Start bringing the cached blocks of ``token_ids`` back to the device from the lower KV tiers (a session
        whose next turn is coming); the number of blocks on their way (0: on the device already, or nowhere)."""
        return await self.call("warm_prefix", list(token_ids), cache_salt)

    async def unpin_prefix(self, pin_id: str) -> None:
        await self.call("unpin_prefix", pin_id)

    async def pins(self) -> dict[str, tuple[int, int]]:
        """The core's pins: pin id -> (tokens, blocks pinned now)."""
        return await self.call("pins")
