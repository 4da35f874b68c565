"""Speculative decoding through the server (``--speculative ngram``): a request's ``speculative`` switch (greedy
output the same either way), its bad values, the options' bad values, the drafted / accepted counters on /metrics,
and a session's regenerated or edited turn drafting from the reply it replaces (app/sessions/earlier_reply.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from app.cli import build_parser
from app.cli import serve as cli_serve
from app.sessions.earlier_reply import last_reply_ids, turn_reply_ids
from app.sessions.store import TOKEN_END, Session
from engine.sampling_params import MAX_SPECULATIVE_CONTEXT
from tests.server_harness import Metrics, RunningServer, server_fixture, sse_chunks, sse_data

server = server_fixture("--speculative", "ngram")

GREEDY = {"temperature": 0, "max_tokens": 24}
# the reply repeats what the prompt holds: n-gram drafts from the prompt are accepted
REPETITIVE = [
    {
        "role": "user",
        "content": "Copy this list exactly: apple, banana, cherry, apple, banana, cherry, apple, "
        "banana, cherry, apple, banana, cherry.",
    }
]
DRAFTS = "pagedchat:spec_decode_num_draft_tokens_total"
ACCEPTED = "pagedchat:spec_decode_num_accepted_tokens_total"
VERIFIED = "pagedchat:spec_decode_num_drafts_total"


def post(server: RunningServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json=body, timeout=120)


def spec_counts(server: RunningServer) -> tuple[float, float, float]:
    metrics: Metrics = server.metrics()
    return tuple(metrics.value(name) for name in (VERIFIED, DRAFTS, ACCEPTED))


def streamed_text(server: RunningServer, body: dict) -> str:
    with httpx.stream(
        "POST", server.url("/v1/chat/completions"), json={**body, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200, response.read()
        chunks = sse_chunks(sse_data(response.iter_lines()))
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_greedy_stream_is_the_same_with_speculation_off_and_on_and_metrics_count_it(
    server: RunningServer,
):
    body = {"messages": REPETITIVE, **GREEDY}
    before = spec_counts(server)
    plain = streamed_text(server, {**body, "speculative": False})
    after_plain = spec_counts(server)
    assert after_plain == before, "a request with speculative false gets no drafts"
    drafted = streamed_text(server, body)
    verified, drafts, accepted = (b - a for a, b in zip(after_plain, spec_counts(server)))
    assert drafted == plain and plain
    assert verified > 0 and drafts >= verified and 0 < accepted <= drafts


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": REPETITIVE, "speculative": "yes"}),
        ("/v1/chat/completions", {"messages": REPETITIVE, "speculative": 2}),
        ("/v1/completions", {"prompt": "Hello", "speculative": 1}),
        ("/v1/responses", {"input": "Hello", "speculative": None}),
    ],
)
def test_speculative_must_be_a_boolean(server: RunningServer, path: str, body: dict):
    response = post(server, path, {**body, "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "speculative" and "speculative" in error["message"]


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--num-speculative-tokens", "0"], "num_speculative_tokens: must be in [1, 16]"),
        (["--num-speculative-tokens", "17"], "num_speculative_tokens: must be in [1, 16]"),
        (["--speculative-max-batch", "0"], "speculative_max_batch: must be in [1, 4096]"),
    ],
)
def test_bad_speculative_options_exit_2_with_one_line(capsys, flags: list[str], said: str):
    assert cli_serve(build_parser().parse_args(["serve", "--speculative", "ngram", *flags])) == 2
    assert capsys.readouterr().err == f"pagedchat: {said}\n"


def test_an_unknown_speculative_method_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--speculative", "eagle"])
    assert exit_info.value.code == 2
    assert "argument --speculative: invalid choice: 'eagle'" in capsys.readouterr().err


# a session's regenerated and edited turns ------------------------------------------------------------------


# alone, after the tests spread over workers (Makefile): the engine gives drafts by its learned step prices, and a
# machine loaded by the other tests' servers skewed them towards none for all three regenerations (CI, 2 vCPUs)
@pytest.mark.serial
def test_a_regeneration_and_a_forks_first_turn_draft_from_the_reply_they_replace(
    server: RunningServer,
):
    """The reply is not in the prompt, so the first turn's drafts mostly miss; answered again (greedy: the same
    reply), the drafts come from the earlier reply and most are accepted."""
    session_id = post(server, "/v1/sessions", {}).json()["id"]
    message = {"content": "Write a short poem about autumn rain.", **GREEDY, "ignore_eos": True}
    turns = f"/v1/sessions/{session_id}/messages"
    before = spec_counts(server)
    first = post(server, turns, message).json()
    first_accepted = spec_counts(server)[2] - before[2]
    reply = first["choices"][0]["message"]["content"]
    # (the engine sizes drafts by its learned step prices, which a loaded machine can skew towards none for a
    # while: each regeneration replaces the same reply with the same one, so up to three are asked for)
    accepted_by_regeneration = []
    for _ in range(3):
        start = spec_counts(server)[2]
        again = post(server, turns, {"regenerate": True, **GREEDY, "ignore_eos": True}).json()
        accepted_by_regeneration.append(spec_counts(server)[2] - start)
        assert again["choices"][0]["message"]["content"] == reply
        if accepted_by_regeneration[-1] > max(first_accepted, GREEDY["max_tokens"] // 2):
            break
    assert max(accepted_by_regeneration) > max(first_accepted, GREEDY["max_tokens"] // 2), (
        first_accepted,
        accepted_by_regeneration,
    )

    # the chat UI's edit (and its regenerate): a fork before the turn, then the user's message there
    fork = post(server, f"/v1/sessions/{session_id}/fork", {"turn": 0}).json()
    start = spec_counts(server)[2]
    edited = post(server, f"/v1/sessions/{fork['id']}/messages", message).json()
    assert edited["choices"][0]["message"]["content"] == reply
    assert spec_counts(server)[2] - start > max(first_accepted, GREEDY["max_tokens"] // 2)


def _marked(ids_per_message: list[tuple[str, int]]) -> list[dict]:
    """Messages with their token marks: each (role, number of its ids)."""
    out, end = [], 0
    for role, count in ids_per_message:
        end += count
        out.append({"role": role, "content": role, TOKEN_END: end})
    return out


def test_a_turns_reply_ids_lie_between_its_prompt_and_the_next_turn():
    # turn 0: user (5 ids, the prompt), assistant (3); turn 1: user (2), assistant (4), tool (1), assistant (2)
    messages = _marked([("user", 5), ("assistant", 3), ("user", 2), ("assistant", 4)])
    messages += _marked([("tool", 1), ("assistant", 2)])
    for message in messages[4:]:
        message[TOKEN_END] += 14
    session = Session(id="s", messages=messages, token_ids=list(range(100, 117)))
    assert turn_reply_ids(session, 0) == [105, 106, 107]
    assert turn_reply_ids(session, 1) == list(range(110, 117))
    assert turn_reply_ids(session, 2) == []
    messages[2] = {k: v for k, v in messages[2].items() if k != TOKEN_END}  # (a mark not known)
    assert turn_reply_ids(session, 1) == []


def test_the_last_reply_ids_are_the_stored_completion_bounded():
    usage = {"prompt_tokens": 4, "completion_tokens": 3}
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "usage": usage}]
    assert last_reply_ids(Session(id="s", messages=messages, token_ids=[7] * 4 + [1, 2, 3])) == [
        1,
        2,
        3,
    ]
    assert last_reply_ids(Session(id="s", messages=messages, token_ids=[])) == []  # (ids reset)
    long = {"prompt_tokens": 1, "completion_tokens": MAX_SPECULATIVE_CONTEXT + 5}
    ids = list(range(MAX_SPECULATIVE_CONTEXT + 6))
    messages[1] = {"role": "assistant", "usage": long}
    assert (
        last_reply_ids(Session(id="s", messages=messages, token_ids=ids))
        == ids[1 : MAX_SPECULATIVE_CONTEXT + 1]
    )


def test_speculative_is_in_the_openapi_schema_of_a_chat_request(server: RunningServer):
    schema = httpx.get(server.url("/openapi.json"), timeout=30).json()
    text = json.dumps(schema["components"]["schemas"]["ChatCompletionRequest"])
    assert '"speculative"' in text
