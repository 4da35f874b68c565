"""One grammar matcher's part of a step, wherever the matcher lives (the engine core's process or the matcher
server, engine/output/remote_matchers.py): its next-token mask, and consuming the sampled token, each failure as
the message that ends its request. No torch: the matcher server imports this."""

from __future__ import annotations

from typing import Any


def next_mask(matcher: Any, pointer: int, num_bytes: int) -> str | None:
    """``matcher``'s next-token mask (packed int32 words) written at ``pointer``; None, or why its grammar
    failed (the words are then undefined)."""
    try:
        matcher.unsafe_compute_mask_ptr(pointer, num_bytes)
        if matcher.is_error():
            raise ValueError(matcher.get_error().splitlines()[0])
    except Exception as exc:  # noqa: BLE001 - one request's grammar fault ends that request only
        return f"response_format: grammar failed: {exc}"
    return None


def consume(matcher: Any, token_id: int) -> None:
    """Advance ``matcher`` by its sampled token; ValueError naming response_format if the grammar refuses it."""
    if not matcher.consume_token(token_id):
        reason = (matcher.get_error() or "refused").splitlines()[0]
        raise ValueError(f"response_format: token {token_id} does not fit the grammar: {reason}")
