"""Reasoning models and token-marked tool calls, on a tiny random Qwen3 with Qwen3's real tokenizer and chat
template (tests/tiny_qwen3.py; the same model with DeepSeek-R1's template, whose generation prompt opens
``<think>``):

- a session on Qwen3's template, which drops a reply's reasoning once the next user message follows it, still
  extends the stored tokens: turn 3 reports >= 90% of its prompt cached, and the whole conversation is never
  re-rendered;
- the reply's reasoning goes to ``reasoning_content`` (streamed as ``delta.reasoning_content``), never to
  ``content``;
- with ``tool_choice: auto`` a model that starts a call (its ``<tool_call>`` token, here pushed by logit_bias: the
  model is random) is constrained from there on: the call's arguments parse and validate.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from tests.server_harness import RunningServer, running_server
from tests.tiny_qwen3 import TOKEN_IDS, cached_tiny_qwen3_gguf

pytestmark = pytest.mark.slow

THINK, END_THINK, TOOL_CALL = (TOKEN_IDS[t] for t in ("<think>", "</think>", "<tool_call>"))
SYSTEM = "You are a careful assistant. " + " ".join(
    f"Rule {i}: answer the question about topic {i} briefly and politely." for i in range(24)
)


def _serve(template: str) -> Iterator[RunningServer]:
    with running_server("--model", str(cached_tiny_qwen3_gguf(template))) as server:
        yield server


@pytest.fixture(scope="module")
def qwen3() -> Iterator[RunningServer]:
    yield from _serve("Qwen-Qwen3-0.6B")


@pytest.fixture(scope="module")
def r1() -> Iterator[RunningServer]:
    yield from _serve("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B")


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_base_url, api_key="x", max_retries=0, timeout=120)


def _model(server: RunningServer) -> str:
    return httpx.get(server.url("/v1/models"), timeout=10).json()["data"][0]["id"]


def test_turn_three_of_a_session_on_qwen3s_template_is_90_percent_cached(qwen3: RunningServer):
    client, model = _client(qwen3), _model(qwen3)
    session = secrets.token_urlsafe(16)[:22]
    questions = ["What is topic 3 about?", "And topic 7?", "Which of the two is longer?"]
    usages = []
    for i, question in enumerate(questions):
        messages = [{"role": "user", "content": question}]
        if i == 0:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        reply = client.chat.completions.create(
            model=model,
            messages=messages,
            temperature=0,
            max_tokens=12,
            # the reply opens its reasoning (the model is random: the bias makes it think first)
            logit_bias={str(THINK): 100} if i == 1 else None,
            extra_body={"session_id": session},
        )
        usages.append(reply.usage)
    third = usages[2]
    assert third.prompt_tokens_details.cached_tokens >= 0.9 * third.prompt_tokens, usages
    stored = httpx.get(qwen3.url(f"/v1/sessions/{session}"), timeout=10).json()["messages"]
    replies = [m for m in stored if m["role"] == "assistant"]
    assert len(replies) == 3
    assert replies[1].get("reasoning_content"), replies[1]  # the biased reply thought first
    for reply in replies:
        assert "<think>" not in reply["content"] and "</think>" not in reply["content"]
    assert "re-rendering the whole conversation" not in qwen3.log()


def test_reasoning_streams_as_reasoning_content_never_as_content(r1: RunningServer):
    """DeepSeek-R1's generation prompt opens ``<think>`` (with thinking on: reasoning_effort high sets the
    template's enable_thinking): what the model writes is reasoning until it closes it (kept open by a bias against
    ``</think>``; closed at once by a bias for it)."""
    client, model = _client(r1), _model(r1)
    ask = [{"role": "user", "content": "Why is the sky blue?"}]
    for bias, thinking in ((-100, True), (100, False)):
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=ask,
                temperature=0,
                max_tokens=10,
                logit_bias={str(END_THINK): bias},
                reasoning_effort="high",
                stream=True,
            )
        )
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        whole = client.chat.completions.create(
            model=model,
            messages=ask,
            temperature=0,
            max_tokens=10,
            logit_bias={str(END_THINK): bias},
            reasoning_effort="high",
        )
        message = whole.choices[0].message
        assert (getattr(message, "reasoning_content", None) or "") == reasoning
        assert (message.content or "") == content
        if thinking:
            assert reasoning and not content
        else:  # (the bias goes on pushing </think>: the answer is made of them, none of it reasoning)
            assert not reasoning and content.startswith("</think>")


def test_auto_constrains_a_call_once_the_model_starts_one(qwen3: RunningServer):
    client, model = _client(qwen3), _model(qwen3)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer"}},
        "required": ["city", "days"],
    }
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": schema}}]
    ask = [{"role": "user", "content": "Forecast for Oslo?"}]
    free = client.chat.completions.create(
        model=model, messages=ask, tools=tools, temperature=0, max_tokens=8
    )
    assert free.choices[0].message.tool_calls is None  # a random model writes text...
    reply = client.chat.completions.create(
        model=model,
        messages=ask,
        tools=tools,
        temperature=0,
        max_tokens=80,
        logit_bias={str(TOOL_CALL): 100},  # ...until it starts a call
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    choice = reply.choices[0]
    [call] = choice.message.tool_calls
    assert call.function.name == "forecast" and choice.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), schema)
