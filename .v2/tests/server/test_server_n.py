"""Several choices per request (OpenAI's ``n``, and ``best_of`` on completions) against a running server: the
choices are numbered 0..n-1 (each prompt's in turn), greedy choices all equal the single answer of the offline
engine, usage counts the prompt once and every choice's completion, streamed choices interleave with one finish
chunk each, best_of returns the sample of highest cumulative logprob, and the limits are 400s naming the field
(session turns store one reply: n must be 1 there).

Expected values come from the offline engine, the tokenizer, or a second request whose per-token logprobs are
summed here; replies are kept to a few tokens."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server_harness import (
    RunningServer,
    offline_chat,
    offline_generate,
    offline_llm,
    server_fixture,
    sse_chunks,
    sse_data,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
SEA = [{"role": "user", "content": "Write one sentence about the sea."}]
PROMPTS = ["The three primary colours are", "def fibonacci(n):"]

server = server_fixture()


def post(server: RunningServer, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url(route), json=body, timeout=120)


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()


def stream_chunks(server: RunningServer, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed answer (sse_chunks asserts ``[DONE]`` comes once, last)."""
    with httpx.stream(
        "POST", server.url(route), json={**body, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200, response.read()
        return sse_chunks(sse_data(response.iter_lines()))


def assert_refused(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error


def greedy_chat(messages: list[dict[str, str]]):
    return offline_chat(messages, temperature=0.0, max_tokens=MAX_TOKENS)


def greedy_completion(prompt: str):
    return offline_generate([prompt], temperature=0.0, max_tokens=MAX_TOKENS)[0]


# non-streamed --------------------------------------------------------------------------------------


def test_chat_n3_greedy_gives_three_copies_of_the_single_answer_and_sums_their_tokens(
    server: RunningServer,
):
    expected = greedy_chat(SEA)
    reply = ok(
        post(
            server,
            "/v1/chat/completions",
            {"messages": SEA, "n": 3, "temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": True},
        )
    )
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    for choice in reply["choices"]:
        assert choice["message"] == {"role": "assistant", "content": expected.text}
        assert choice["finish_reason"] == expected.finish_reason
        # each choice its own logprobs
        assert len(choice["logprobs"]["content"]) == len(expected.token_ids)
    usage = reply["usage"]
    # once, not three times
    assert usage["prompt_tokens"] == len(offline_llm().chat_prompt_ids(SEA))
    assert usage["completion_tokens"] == 3 * len(expected.token_ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_completion_n3_greedy_gives_three_copies_of_the_single_answer(server: RunningServer):
    expected = greedy_completion(PROMPTS[0])
    reply = ok(
        post(
            server,
            "/v1/completions",
            {"prompt": PROMPTS[0], "n": 3, "temperature": 0, "max_tokens": MAX_TOKENS},
        )
    )
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert [c["text"] for c in reply["choices"]] == [expected.text] * 3
    assert {c["finish_reason"] for c in reply["choices"]} == {expected.finish_reason}
    assert reply["usage"]["prompt_tokens"] == len(offline_llm().tokenizer.encode(PROMPTS[0]))
    assert reply["usage"]["completion_tokens"] == 3 * len(expected.token_ids)


def test_two_prompts_n2_number_each_prompts_choices_in_turn_with_echo(server: RunningServer):
    expected = [greedy_completion(p) for p in PROMPTS]
    reply = ok(
        post(
            server,
            "/v1/completions",
            {"prompt": PROMPTS, "n": 2, "temperature": 0, "max_tokens": MAX_TOKENS, "echo": True},
        )
    )
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in reply["choices"]] == [
        PROMPTS[i // 2] + expected[i // 2].text for i in range(4)
    ]
    tokenizer = offline_llm().tokenizer
    assert reply["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(p)) for p in PROMPTS)
    assert reply["usage"]["completion_tokens"] == 2 * sum(len(e.token_ids) for e in expected)


# streamed ------------------------------------------------------------------------------------------


def test_streamed_chat_n2_interleaves_its_choices_with_one_finish_chunk_each(server: RunningServer):
    expected = greedy_chat(SEA)
    chunks = stream_chunks(
        server,
        "/v1/chat/completions",
        {
            "messages": SEA,
            "n": 2,
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
            "stream_options": {"include_usage": True},
        },
    )
    usage_chunk, chunks = chunks[-1], chunks[:-1]
    assert usage_chunk["choices"] == [] and all(len(c["choices"]) == 1 for c in chunks)
    choices = [c["choices"][0] for c in chunks]
    assert [c["delta"] for c in choices[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [c["index"] for c in choices[:2]] == [0, 1]
    order = [c["index"] for c in choices[2:]]
    assert sum(a != b for a, b in zip(order, order[1:])) >= 2, (
        f"the choices came one after the other: {order}"
    )
    for index in (0, 1):
        mine = [c for c in choices if c["index"] == index]
        assert "".join(c["delta"].get("content") or "" for c in mine) == expected.text
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + [
            expected.finish_reason
        ]
    assert usage_chunk["usage"]["prompt_tokens"] == len(offline_llm().chat_prompt_ids(SEA))
    assert usage_chunk["usage"]["completion_tokens"] == 2 * len(expected.token_ids)


def test_streamed_completion_n2_gives_each_choice_its_text_and_one_finish(server: RunningServer):
    expected = greedy_completion(PROMPTS[1])
    chunks = stream_chunks(
        server,
        "/v1/completions",
        {"prompt": PROMPTS[1], "n": 2, "temperature": 0, "max_tokens": MAX_TOKENS},
    )
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert {c["index"] for c in choices} == {0, 1}
    for index in (0, 1):
        mine = [c for c in choices if c["index"] == index]
        assert "".join(c["text"] for c in mine) == expected.text
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + [
            expected.finish_reason
        ]


# best_of -------------------------------------------------------------------------------------------


def test_best_of_returns_the_sample_of_highest_cumulative_logprob(server: RunningServer):
    """Sample i of a seeded request is reproducible, so n=3 with logprobs shows the three samples best_of=3
    chooses from; their summed token logprobs rank them here."""
    sampled = {"prompt": PROMPTS[0], "temperature": 1.0, "seed": 2024, "max_tokens": MAX_TOKENS}
    every = ok(post(server, "/v1/completions", {**sampled, "n": 3, "logprobs": 0}))["choices"]
    assert len({c["text"] for c in every}) > 1, "the samples were meant to differ"
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in every]
    best = every[max(range(3), key=lambda i: (scores[i], -i))]

    reply = ok(post(server, "/v1/completions", {**sampled, "n": 1, "best_of": 3}))
    (choice,) = reply["choices"]
    assert choice["index"] == 0 and choice["text"] == best["text"]
    assert choice["logprobs"] is None, (
        "logprobs computed for the ranking are not handed out unless asked"
    )
    # usage: every generated sample's tokens, as OpenAI counts best_of
    assert reply["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in every)


def test_best_of_equal_to_n_streams(server: RunningServer):
    chunks = stream_chunks(
        server,
        "/v1/completions",
        {"prompt": PROMPTS[0], "n": 2, "best_of": 2, "temperature": 0, "max_tokens": 4},
    )
    assert {c["index"] for chunk in chunks for c in chunk["choices"]} == {0, 1}


# limits --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": SEA, "n": 129}, "n"),
        ("/v1/completions", {"prompt": "Hi", "n": 129}, "n"),
        ("/v1/completions", {"prompt": "Hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "Hi", "best_of": 129}, "best_of"),
        ("/v1/completions", {"prompt": "Hi", "n": 3, "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": "Hi", "n": 1, "best_of": 3, "stream": True}, "best_of"),
    ],
    ids=[
        "chat_n_129",
        "completion_n_129",
        "completion_n_0",
        "best_of_129",
        "best_of_below_n",
        "stream_with_best_of_over_n",
    ],
)
def test_out_of_range_choices_are_refused_naming_the_field(
    server: RunningServer, route: str, body: dict[str, Any], param: str
):
    assert_refused(post(server, route, {**body, "max_tokens": 4}), param)


def test_session_turn_with_n_over_1_is_refused_and_leaves_the_session_usable(server: RunningServer):
    created = post(server, "/v1/sessions", {})
    assert created.status_code == 201, created.text
    session_id = created.json()["id"]
    assert_refused(
        post(
            server,
            f"/v1/sessions/{session_id}/messages",
            {"content": "Hi", "n": 2, "max_tokens": 4},
        ),
        "n",
    )
    reply = ok(
        post(server, f"/v1/sessions/{session_id}/messages", {"content": "Hi", "max_tokens": 4})
    )
    assert len(reply["choices"]) == 1  # the refused turn held no lock


def test_chat_completion_in_a_new_session_with_n_over_1_creates_nothing(server: RunningServer):
    session_id = "n" * 22  # well formed, unknown: a first turn would start it
    assert_refused(
        post(
            server,
            "/v1/chat/completions",
            {"messages": SEA, "n": 2, "max_tokens": 4, "session_id": session_id},
        ),
        "n",
    )
    assert httpx.get(server.url(f"/v1/sessions/{session_id}"), timeout=10).status_code == 404


# beam search (extension fields) ---------------------------------------------------------------------


def test_completion_beam_search_returns_the_offline_engines_n_best(server: RunningServer):
    beam = {"use_beam_search": True, "beam_width": 3, "n": 2, "max_tokens": MAX_TOKENS}
    expected = offline_generate([PROMPTS[1]], **beam)
    reply = ok(post(server, "/v1/completions", {"prompt": PROMPTS[1], **beam}))
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert [c["text"] for c in reply["choices"]] == [o.text for o in expected]
    assert reply["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in expected)


def test_streamed_chat_beam_search_sends_each_choice_once_finished(server: RunningServer):
    beam = {"use_beam_search": True, "beam_width": 2, "max_tokens": MAX_TOKENS}
    expected = offline_chat(SEA, **beam)
    chunks = stream_chunks(server, "/v1/chat/completions", {"messages": SEA, **beam})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == expected.text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"use_beam_search": True, "beam_width": 2, "n": 3}, "n"),
        ({"use_beam_search": True, "logprobs": 1}, "logprobs"),
        ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
        ({"use_beam_search": True, "length_penalty": 11}, "length_penalty"),
    ],
    ids=["n_over_width", "logprobs", "early_stopping", "length_penalty"],
)
def test_bad_beam_search_fields_are_refused_naming_the_field(
    server: RunningServer, body: dict[str, Any], param: str
):
    assert_refused(
        post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, **body}), param
    )
