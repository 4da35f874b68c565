"""RequestStream's wake rule with ``stream_interval`` (engine/request_stream.py), without an engine: a sample's
first token and its end wake the reader at once; other tokens wait until ``stream_interval`` are unread."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from engine.request_stream import RequestStream


def take(sample: SimpleNamespace) -> SimpleNamespace:
    """The output processor's part: everything new since the last read."""
    delta = sample.token_ids[sample.num_taken :]
    sample.num_taken = len(sample.token_ids)
    return SimpleNamespace(
        error=None, finished=sample.finish_reason is not None, token_ids_delta=delta
    )


async def test_the_first_token_and_the_end_wake_the_reader_others_wait_for_the_interval() -> None:
    released: list[bool] = []
    stream = RequestStream("r", take, lambda _id, finished: released.append(finished), None, 1, 4)
    sample = SimpleNamespace(queued=False, token_ids=[7], num_taken=0, finish_reason=None)
    stream.push(sample)
    first = await asyncio.wait_for(stream.__anext__(), 1.0)
    assert first.token_ids_delta == [7]  # not held back for the interval

    reader = asyncio.ensure_future(stream.__anext__())
    for token in (8, 9, 10):  # three unread: below the interval
        sample.token_ids.append(token)
        stream.push(sample)
        await asyncio.sleep(0)
        assert not reader.done()
    sample.token_ids.append(11)  # the fourth
    stream.push(sample)
    assert (await asyncio.wait_for(reader, 1.0)).token_ids_delta == [8, 9, 10, 11]

    sample.token_ids.append(12)
    sample.finish_reason = "length"  # the end: at once, though one token is unread
    stream.push(sample)
    last = await asyncio.wait_for(stream.__anext__(), 1.0)
    assert last.token_ids_delta == [12] and last.finished
    assert released == [True]
