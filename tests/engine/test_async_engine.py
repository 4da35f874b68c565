"""AsyncEngine: the engine thread behind asyncio — concurrent streams, aborts, and failures that reach
every consumer instead of hanging."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.sampling_params import SamplingParams
from tests.engine_faults import check_idle_pool, fail_model_after

PROMPTS = [f"Tell me fact number {i} about the ocean." for i in range(16)]


async def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def consume(
    engine: AsyncEngine,
    prompt_ids: list[int],
    params: SamplingParams,
    request_id: str,
    stop_after: int | None = None,
) -> list:
    outputs = []
    async with contextlib.aclosing(
        engine.generate(prompt_ids, params, request_id=request_id)
    ) as stream:
        async for out in stream:
            outputs.append(out)
            if stop_after is not None and len(outputs) >= stop_after:
                break  # the consumer walks away: aclose() aborts the request
    return outputs


async def abort_after_first_token(engine: AsyncEngine, prompt_ids: list[int]) -> list:
    """engine.abort() ends the stream with a final ``abort`` output (the consumer keeps reading)."""
    outputs = []
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    async for out in engine.generate(prompt_ids, params, request_id="explicit"):
        if not outputs:
            await engine.abort("explicit")
        outputs.append(out)
    return outputs


@pytest.mark.asyncio(loop_scope="module")
async def test_concurrent_streams_with_aborts_leave_every_block_free(shared_engine: AsyncEngine):
    tok = shared_engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tasks = {}
    for i, text in enumerate(PROMPTS):
        stop_after = 3 if i % 4 == 1 else None
        tasks[i] = asyncio.create_task(
            consume(shared_engine, tok.encode(text), params, f"r{i}", stop_after)
        )
    explicit = asyncio.create_task(
        abort_after_first_token(shared_engine, tok.encode("Abort me explicitly."))
    )
    results = {i: await t for i, t in tasks.items()}
    aborted = await explicit
    for i, outputs in results.items():
        if i % 4 == 1:
            assert len(outputs) == 3 and not outputs[-1].finished
        else:
            assert outputs[-1].finished and len(outputs[-1].token_ids) == 24
            assert [t for o in outputs for t in o.token_ids_delta] == outputs[-1].token_ids
    assert aborted[-1].finish_reason == "abort" and len(aborted[-1].token_ids) < 1000
    await wait_for(
        lambda: shared_engine.stats().num_running == 0 and shared_engine.stats().num_waiting == 0
    )
    stats = shared_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert await shared_engine.call(check_idle_pool) == stats.num_blocks
    assert shared_engine.healthy


@pytest.mark.asyncio(loop_scope="module")
async def test_streamed_deltas_equal_offline_output(shared_engine: AsyncEngine):
    tok = shared_engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outputs = await consume(shared_engine, tok.encode(PROMPTS[0]), params, "delta")
    text = "".join(o.text_delta for o in outputs)
    assert text == outputs[-1].text == tok.decode(outputs[-1].token_ids, skip_special_tokens=True)


@pytest.mark.asyncio(loop_scope="module")
async def test_bad_request_raises_value_error_and_engine_keeps_serving(shared_engine: AsyncEngine):
    with pytest.raises(ValueError, match="prompt"):
        await consume(shared_engine, [], SamplingParams(), "empty")
    outputs = await consume(
        shared_engine, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2), "after"
    )
    assert outputs[-1].finished and shared_engine.healthy


async def test_model_error_reaches_every_stream_and_marks_unhealthy(engine: AsyncEngine):
    await engine.call(fail_model_after, 2)  # in the core's process: the third step raises
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    tasks = [
        asyncio.create_task(consume(engine, [1, 2, 3 + i], params, f"doomed{i}")) for i in range(4)
    ]
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert isinstance(results[0].__cause__, RuntimeError)
    assert not engine.healthy
    with pytest.raises(EngineDeadError):
        await consume(engine, [1, 2, 3], params, "late")
