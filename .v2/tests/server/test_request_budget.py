"""The most work one request may buy (``--max-request-tokens``, app/request_budget.py): over its prompts, prompt
tokens + sequences (best_of, else n, or beam_width) x max_tokens, a request without max_tokens counting the
default it gets. A request over the limit is a 400 in OpenAI's shape whose ``param`` names the field to lower,
refused before the engine sees it; one at the limit is served; the option is checked like every other.

Expected totals are counted here by hand from the request (token-id prompts, so their lengths are known), never
taken from the code under test."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel
from starlette.testclient import TestClient

from app.cli import build_parser, server_settings_from_args
from app.errors import APIError
from app.protocol.completions import ChatCompletionRequest, CompletionRequest
from app.replies import ReplyWriter
from app.request_budget import request_tokens
from app.server import create_app
from app.settings import ServerSettings
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from tests.server_harness import SMALL_KV_GIB, one_torch_thread

LIMIT = 100
MAX_MODEL_LEN = 128
DEFAULT_MAX_TOKENS = 4


def ids(count: int) -> list[int]:
    return list(range(100, 100 + count))


# the count, without a model ---------------------------------------------------------------------------------


def test_a_prompt_counts_once_and_every_sequence_its_max_tokens():
    # 5 + 7 prompt tokens; 3 samples x 10 tokens for each prompt
    assert request_tokens([5, 7], [SamplingParams(n=3, max_tokens=10)] * 2) == 12 + 2 * 30
    assert request_tokens([5], [SamplingParams(n=2, best_of=4, max_tokens=10)]) == 5 + 40
    beams = SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=10)
    assert request_tokens([5], [beams]) == 5 + 30


def writer(limit: int = LIMIT) -> ReplyWriter:
    """A ReplyWriter for its SamplingParams alone (no tokenizer needed)."""
    return ReplyWriter(None, "m", MAX_MODEL_LEN, DEFAULT_MAX_TOKENS, {}, limit)  # type: ignore[arg-type]


def refusal(model: type[BaseModel], body: dict[str, Any], lengths: list[int]) -> APIError | None:
    try:
        writer().sampling_params_each(model.model_validate(body), lengths)
    except APIError as exc:
        return exc
    return None


# (body, prompt lengths, the field named); each total counted by hand against LIMIT = 100
OVER = {
    # 12 prompts x (8 + 1): the prompts alone are over
    "many_prompts": ({"prompt": [ids(8)] * 12, "max_tokens": 1}, [8] * 12, "prompt"),
    # 70 + 31: one sequence is over
    "max_tokens": ({"prompt": ids(70), "max_tokens": 31}, [70], "max_tokens"),
    # 97 + the default 4 (not the room left, 31)
    "default_max_tokens": ({"prompt": ids(97)}, [97], "max_tokens"),
    # 12 + 3 x 30: one sequence (42) fits, three do not
    "n": ({"prompt": ids(12), "n": 3, "max_tokens": 30}, [12], "n"),
    # 10 + 4 x 25
    "best_of": ({"prompt": ids(10), "best_of": 4, "max_tokens": 25}, [10], "best_of"),
    # 10 + 4 beams (the default width) x 25
    "beam_width": (
        {"prompt": ids(10), "use_beam_search": True, "max_tokens": 25},
        [10],
        "beam_width",
    ),
}


@pytest.mark.parametrize("case", OVER)
def test_a_completion_over_the_limit_is_refused_naming_the_field_to_lower(case: str):
    body, lengths, field = OVER[case]
    error = refusal(CompletionRequest, body, lengths)
    assert error is not None, "over the limit, yet accepted"
    assert (error.status, error.param, error.code) == (400, field, "request_too_large")
    assert error.message.startswith(f"{field}: ") and str(LIMIT) in error.message


# each at the limit exactly, or one under
AT_THE_LIMIT = {
    "many_prompts": ({"prompt": [ids(8)] * 11, "max_tokens": 1}, [8] * 11),  # 99
    "max_tokens": ({"prompt": ids(70), "max_tokens": 30}, [70]),  # 100
    "default_max_tokens": ({"prompt": ids(96)}, [96]),  # 96 + 4
    "n": ({"prompt": ids(10), "n": 3, "max_tokens": 30}, [10]),  # 100
    "best_of": ({"prompt": ids(10), "best_of": 4, "n": 2, "max_tokens": 22}, [10]),  # 98
}


@pytest.mark.parametrize("case", AT_THE_LIMIT)
def test_a_completion_at_the_limit_is_accepted(case: str):
    body, lengths = AT_THE_LIMIT[case]
    assert refusal(CompletionRequest, body, lengths) is None


def test_chat_names_max_completion_tokens_when_that_is_the_field_given():
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 31}
    error = refusal(ChatCompletionRequest, body, [70])
    assert error is not None and error.param == "max_completion_tokens"
    error = refusal(ChatCompletionRequest, {**body, "max_completion_tokens": 1}, [100])
    assert error is not None and error.param == "messages"


def test_no_limit_when_the_option_is_0():
    body = CompletionRequest.model_validate({"prompt": [ids(8)] * 100, "n": 128, "max_tokens": 100})
    params = writer(limit=0).sampling_params_each(body, [8] * 100)
    assert len(params) == 100 and params[0].num_sequences == 128


# the option ------------------------------------------------------------------------------------------------


def test_the_flag_reaches_the_settings_and_a_bad_value_is_refused_naming_it():
    parse = build_parser().parse_args
    assert (
        server_settings_from_args(
            parse(["serve", "--max-request-tokens", "5000"])
        ).max_request_tokens
        == 5000
    )
    assert ServerSettings().max_request_tokens == 262_144
    with pytest.raises(ValueError, match=r"^max_request_tokens: must be >= 0"):
        server_settings_from_args(parse(["serve", "--max-request-tokens", "-1"]))
    with pytest.raises(SystemExit) as exited:
        parse(["serve", "--max-request-tokens", "lots"])
    assert exited.value.code == 2


def test_serve_with_a_negative_limit_exits_2_with_a_clear_message():
    result = subprocess.run(
        [sys.executable, "-m", "app", "serve", "--max-request-tokens", "-5"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert "max_request_tokens: must be >= 0" in result.stderr, result.stderr


# against the server -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    settings = ServerSettings(
        default_max_tokens=DEFAULT_MAX_TOKENS,
        max_request_tokens=LIMIT,
        session_store="memory",
        engine=EngineConfig(kv_cache_memory_gib=float(SMALL_KV_GIB), max_model_len=MAX_MODEL_LEN),
    )
    with one_torch_thread(), TestClient(create_app(settings)) as client:
        yield client


def engine_work(client: TestClient) -> tuple[int, int]:
    """The engine's prompt tokens and finished requests so far, once it is idle."""
    engine = client.app.state.server.engine
    deadline = time.monotonic() + 30
    while (stats := engine.stats()).num_running + stats.num_waiting and time.monotonic() < deadline:
        time.sleep(0.05)
    return stats.prompt_tokens, sum(stats.finished.values())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", {"prompt": ids(12), "n": 3, "max_tokens": 30}, "n"),
        ("/v1/completions", {"prompt": [ids(8)] * 12, "max_tokens": 1, "stream": True}, "prompt"),
        ("/v1/completions", {"prompt": ids(97)}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "n": 20, "max_tokens": 10},
            "n",
        ),
    ],
)
def test_the_server_refuses_a_request_over_the_limit_before_the_engine_sees_it(
    client: TestClient, route: str, body: dict[str, Any], param: str
):
    before = engine_work(client)
    response = client.post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, "request_too_large")
    assert error["message"].startswith(f"{param}: ")
    assert engine_work(client) == before, "a refused request reached the engine"


@pytest.mark.slow
def test_the_server_serves_a_request_at_the_limit(client: TestClient):
    before = engine_work(client)
    # 10 + 3 x 30 = 100
    body = {"prompt": ids(10), "n": 3, "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert len(answer["choices"]) == 3
    assert answer["usage"] == {**answer["usage"], "prompt_tokens": 10, "completion_tokens": 90}
    after = engine_work(client)
    assert after[0] > before[0] and after[1] > before[1]
