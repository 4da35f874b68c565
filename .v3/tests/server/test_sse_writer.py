"""The SSE writer's own duties: events sent as they come, a keep-alive comment after a quiet spell, the end of
the body, and a client that leaves closing the producer (which aborts its engine request)."""

from __future__ import annotations

import asyncio

from app.sse import EventStream


async def never_disconnects() -> dict:
    await asyncio.sleep(3600)
    return {"type": "http.disconnect"}


async def test_events_then_a_ping_in_a_quiet_spell_then_the_end():
    async def events():
        yield b"data: 1\n\n"
        await asyncio.sleep(0.35)
        yield b"data: 2\n\n"

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(EventStream(events(), ping_s=0.1)(None, never_disconnects, send), 5)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = [m["body"] for m in sent[1:]]
    assert bodies[0] == b"data: 1\n\n" and bodies[-2:] == [b"data: 2\n\n", b""]
    assert 2 <= bodies.count(b": ping\n\n") <= 4  # one per quiet 0.1 s of the 0.35 s gap
    assert sent[-1]["more_body"] is False and all(m["more_body"] for m in sent[1:-1])


async def test_a_client_that_leaves_closes_the_producer():
    closed = asyncio.Event()

    async def endless():
        try:
            while True:
                yield b"data: x\n\n"
                await asyncio.sleep(0.01)
        finally:
            closed.set()

    async def leaves_soon() -> dict:
        await asyncio.sleep(0.1)
        return {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(EventStream(endless())(None, leaves_soon, send), 5)
    assert closed.is_set()
    assert all(m.get("more_body", True) for m in sent)  # no end of body for a client that is gone
