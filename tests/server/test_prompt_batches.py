"""A batch of prompts on /v1/completions is bounded before any per-prompt work (issue 49: 400,000 one-letter
prompts, a 2 MB body, held the front's event loop for seconds and took ~160 s to be refused): the count is
checked on the raw body (at most MAX_PROMPTS), the token budget from below before the tokenizer sees a prompt,
and the prompts that are tokenized go to the tokenizer thread in one trip."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from app.errors import APIError
from app.prompts import PromptRenderer
from app.protocol.completions import CompletionRequest
from app.request_body import MAX_PROMPTS, read_model
from app.request_budget import check_least_tokens
from tests.server.test_request_body import request_with

BODY_CAP = 8 * 2**20


async def test_the_attackers_batch_is_refused_naming_prompt_before_any_prompt_is_built():
    body = json.dumps({"prompt": ["a"] * 400_000, "max_tokens": 1}).encode()
    start = time.perf_counter()
    with pytest.raises(APIError) as refused:
        await read_model(request_with(body), CompletionRequest, BODY_CAP)
    elapsed = time.perf_counter() - start
    assert refused.value.status == 400 and refused.value.param == "prompt"
    assert f"at most {MAX_PROMPTS} prompts" in refused.value.message
    assert "(got 400000)" in refused.value.message
    # pydantic alone builds the 400,000 strings; timed on the same machine, so a busy one slows both
    start = time.perf_counter()
    CompletionRequest.model_validate_json(body)
    pydantic = time.perf_counter() - start
    assert elapsed < pydantic / 3, f"{elapsed * 1e3:.0f} ms, pydantic {pydantic * 1e3:.0f}"


@pytest.mark.parametrize(
    "prompt",
    [[[1, 2]] * (MAX_PROMPTS + 1), ["ab"] * (MAX_PROMPTS + 1)],
    ids=["token-id prompts", "texts"],
)
async def test_one_prompt_over_the_bound_is_refused_and_the_bound_itself_is_read(prompt: list):
    over = json.dumps({"prompt": prompt}).encode()
    with pytest.raises(APIError) as refused:
        await read_model(request_with(over), CompletionRequest, BODY_CAP)
    assert refused.value.param == "prompt"
    at = json.dumps({"prompt": prompt[:MAX_PROMPTS]}).encode()
    parsed = await read_model(request_with(at), CompletionRequest, BODY_CAP)
    assert len(parsed.prompts()) == MAX_PROMPTS


async def test_one_prompt_of_many_token_ids_is_one_prompt():
    ids = list(range(3 * MAX_PROMPTS))
    parsed = await read_model(
        request_with(json.dumps({"prompt": ids}).encode()), CompletionRequest, BODY_CAP
    )
    assert parsed.prompts() == [ids]


async def test_a_long_prompt_of_token_ids_is_read_without_pydantic_building_each_id():
    ids = [(i * 7919) % 50_000 for i in range(500_000)]  # a 4 MiB body's worth
    body = json.dumps({"prompt": ids, "max_tokens": 1}).encode()
    start = time.perf_counter()
    parsed = await read_model(request_with(body), CompletionRequest, BODY_CAP)
    elapsed = time.perf_counter() - start
    assert parsed.prompts() == [ids] and parsed.max_tokens == 1
    start = time.perf_counter()
    CompletionRequest.model_validate_json(body)
    pydantic = time.perf_counter() - start
    assert elapsed < pydantic / 3, f"{elapsed * 1e3:.0f} ms, pydantic {pydantic * 1e3:.0f}"


@pytest.mark.parametrize(
    ("last", "accepted"), [(2**31, False), (-1, False), (5.0, True), (True, False)]
)
async def test_a_long_prompt_of_token_ids_is_checked_as_pydantic_checks_it(last, accepted: bool):
    body = json.dumps({"prompt": [1] * 50_000 + [last]}).encode()
    if accepted:
        parsed = await read_model(request_with(body), CompletionRequest, BODY_CAP)
        assert parsed.prompts() == [[1] * 50_000 + [int(last)]]
        return
    with pytest.raises(APIError) as refused:
        await read_model(request_with(body), CompletionRequest, BODY_CAP)
    assert refused.value.status == 400 and refused.value.param.startswith("prompt")


async def test_a_prompt_that_is_not_a_list_is_still_pydantics_to_refuse():
    with pytest.raises(APIError) as refused:
        await read_model(
            request_with(json.dumps({"prompt": {"a": 1}}).encode()), CompletionRequest, BODY_CAP
        )
    assert (refused.value.status, refused.value.param) == (400, "prompt")


# the budget from below ---------------------------------------------------------------------------------------


def body_of(prompt: list) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": prompt})


def test_texts_count_one_token_each_and_token_ids_their_length():
    # 50 texts: at least 50 prompt tokens + 50 generated = 100
    check_least_tokens(body_of(["a"] * 50), ["a"] * 50, 100)
    with pytest.raises(APIError) as refused:
        check_least_tokens(body_of(["a"] * 51), ["a"] * 51, 100)
    assert (refused.value.param, refused.value.code) == ("prompt", "request_too_large")
    assert "51 prompts take at least 102 tokens" in refused.value.message
    # two prompts of 49 ids: 98 + 2 = 100; one more id is over
    check_least_tokens(body_of([[1] * 49] * 2), [[1] * 49] * 2, 100)
    with pytest.raises(APIError):
        check_least_tokens(body_of([[1] * 49, [1] * 50]), [[1] * 49, [1] * 50], 100)
    check_least_tokens(body_of(["a"] * 51), ["a"] * 51, 0)  # 0: no limit


# tokenizing off the event loop ------------------------------------------------------------------------------


class GateTokenizer:
    """encode() waits until the event loop has run a callback: on the loop's own thread it would wait forever."""

    def __init__(self) -> None:
        self.loop_ran = threading.Event()
        self.threads: set[str] = set()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert self.loop_ran.wait(timeout=30), "the event loop was held while tokenizing"
        self.threads.add(threading.current_thread().name)
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)


async def test_a_batch_is_tokenized_on_the_tokenizer_thread_while_the_loop_runs():
    tokenizer = GateTokenizer()
    renderer = PromptRenderer(tokenizer)
    try:
        asyncio.get_running_loop().call_soon(tokenizer.loop_ran.set)
        ids = await renderer.encode_each(["ab", [7, 8], "c"])
        assert ids == [[97, 98], [7, 8], [99]]
        assert len(tokenizer.threads) == 1 and tokenizer.threads.pop().startswith(
            "pagedchat-tokenizer"
        )
        assert await renderer.decode_each(ids) == ["ab", "\x07\x08", "c"]
    finally:
        renderer.close()
