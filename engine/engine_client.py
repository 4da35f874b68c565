"""EngineClient: the front's view of a running engine core, as a typed interface. The server (app/) is written
against it; AsyncEngine (async_engine.py: the core in its own process) is the implementation, and a test holds
the two together."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import Any, Protocol, runtime_checkable

from engine.core.core_info import CoreInfo
from engine.core.metrics import EngineStats
from engine.request_stream import RequestStream
from engine.sampling_params import SamplingParams, StructuredOutput


@runtime_checkable
class EngineClient(Protocol):
    info: CoreInfo | None  # the core's resolved facts (model, limits, EOS ids), once started
    # the model's tokenizer in this process (None for dummy weights): the prompt thread's and the detokenizer's
    tokenizer: Any | None

    async def start(self) -> None:
        """Start (or attach to) the core; raises ValueError for a configuration mistake."""

    async def stop(self) -> None:
        """Stop the core (this front's share of it); every open stream ends."""

    @property
    def healthy(self) -> bool:
        """False once the core failed or its process ended: nothing more can be served."""

    def stats(self) -> EngineStats:
        """The latest snapshot the core sent."""

    @property
    def num_queued(self) -> int:
        """Requests submitted that have not produced their first output yet."""

    def num_queued_for(self, tenant: str) -> int:
        """Of ``num_queued``, those of ``tenant``."""

    def validate_request(self, prompt_token_ids: SequenceOf[int], params: SamplingParams) -> None:
        """ValueError naming the field when the request can never run."""

    async def compile_structured_output(self, spec: StructuredOutput) -> StructuredOutput:
        """A response_format's grammar compiled off the event loop (ValueError when it cannot be)."""

    def generate(
        self,
        prompt_token_ids: SequenceOf[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        tenant: str = "",
        priority: int = 0,
        retain: bool = False,
    ) -> RequestStream:
        """Submit a request now; its stream of outputs (closing it early aborts the request). ``retain``: a
        session's turn (its blocks outrank one-off ones, and go down to the lower KV tiers when it ends)."""

    async def abort(self, request_id: str) -> None:
        """End a request now; its blocks are free at the core's next step."""

    async def pin_prefix(
        self,
        pin_id: str,
        token_ids: SequenceOf[int],
        cache_salt: str | None = None,
        share: float = 1.0,
        group: str | None = None,
        group_share: float = 1.0,
    ) -> int:
        """Compute ``token_ids`` once and pin their full blocks (caps: shares of the KV pool); blocks pinned."""

    async def warm_prefix(self, token_ids: SequenceOf[int], cache_salt: str | None = None) -> int:
        """Start bringing the blocks of ``token_ids`` back from the lower KV tiers; blocks on their way."""

    async def unpin_prefix(self, pin_id: str) -> None:
        """Release a pin."""

    async def pins(self) -> dict[str, tuple[int, int]]:
        """Pin id -> (its tokens, blocks pinned now)."""
