"""OpenAI's Responses API through the official ``openai`` client: a response answers as the chat completion of the
same conversation does; streamed events (``responses.create(stream=True)`` and the ``responses.stream`` helper)
build the same response as the deltas say; ``previous_response_id`` continues the conversation with its history
from the prefix cache; a forced function call's arguments validate against its schema and its output continues
the conversation; another key's response is not found; bad input is a 400 (or 404) naming the field."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from tests.server_harness import RunningServer, running_server, server_fixture
from tests.tiny_qwen3 import TOKEN_IDS, cached_tiny_qwen3_gguf

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEYS = ("alice", "bob")
BLOCK_SIZE = 16  # the engine's default: the prefix cache holds whole blocks
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}

server = server_fixture("--api-key", ",".join(KEYS))


def make_client(server: RunningServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_base_url, api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def qwen3() -> Iterator[RunningServer]:
    """A tiny random Qwen3 with Qwen3's real tokenizer and template (tests/tiny_qwen3.py): a reasoning model."""
    with running_server("--model", str(cached_tiny_qwen3_gguf("Qwen-Qwen3-0.6B"))) as server:
        yield server


@pytest.fixture(scope="module")
def alice(server: RunningServer) -> openai.OpenAI:
    return make_client(server, "alice")


@pytest.fixture(scope="module")
def bob(server: RunningServer) -> openai.OpenAI:
    return make_client(server, "bob")


def post(server: RunningServer, body: dict, key: str = "alice") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(server.url("/v1/responses"), json=body, headers=headers, timeout=120)


def assert_error(response: httpx.Response, status: int, param: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith("response " if status == 404 else param)
    return error["message"]


def forced_call(client: openai.OpenAI, **fields):
    """A response that must call get_weather (one call: the grammar then ends the reply)."""
    return client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=40,
        **fields,
    )


# text ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("store", [True, False])
def test_response_answers_as_the_chat_completion_of_its_conversation(
    alice: openai.OpenAI, store: bool
):
    instructions, question = "You answer in one short sentence.", "Why is the sky blue?"
    reply = alice.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": instructions},
            {"role": "user", "content": question},
        ],
        temperature=0,
        max_tokens=12,
    )
    response = alice.responses.create(
        model=MODEL,
        instructions=instructions,
        input=question,
        temperature=0,
        max_output_tokens=12,
        store=store,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == reply.choices[0].message.content
    assert response.usage.input_tokens == reply.usage.prompt_tokens
    assert response.usage.output_tokens == reply.usage.completion_tokens
    cut = reply.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if cut else "completed")
    if cut:
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.instructions == instructions and response.store is store
    if store:
        stored = alice.responses.retrieve(response.id)
        assert stored.output_text == response.output_text and stored.usage == response.usage


def test_unstored_response_branches_from_any_turn(alice: openai.OpenAI):
    """With store false nothing is kept, so a response may follow an earlier one of a conversation: it answers as
    the chat completion of that history (and the conversation's instructions) would."""
    fields = {"model": MODEL, "temperature": 0, "max_output_tokens": 6}
    first = alice.responses.create(**fields, instructions="Be brief.", input="Name a fruit.")
    alice.responses.create(**fields, input="Another one.", previous_response_id=first.id)
    branch = alice.responses.create(
        **fields, input="Name a vegetable.", previous_response_id=first.id, store=False
    )
    reply = alice.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a fruit."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Name a vegetable."},
        ],
        temperature=0,
        max_tokens=6,
    )
    assert branch.previous_response_id == first.id
    assert branch.output_text == reply.choices[0].message.content
    assert branch.usage.input_tokens == reply.usage.prompt_tokens


def test_streamed_events_build_the_whole_response(alice: openai.OpenAI):
    whole = alice.responses.create(
        model=MODEL, input="Name three colours.", temperature=0, max_output_tokens=10, store=False
    )
    events = list(
        alice.responses.create(
            model=MODEL,
            input="Name three colours.",
            temperature=0,
            max_output_tokens=10,
            store=False,
            stream=True,
        )
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == (
        "response.incomplete" if whole.status == "incomplete" else "response.completed"
    )
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert deltas == done.text == whole.output_text
    final = events[-1].response
    assert (
        final.output_text == whole.output_text
        and final.usage.output_tokens == whole.usage.output_tokens
    )


def test_raw_stream_names_each_event(server: RunningServer):
    headers = {"Authorization": "Bearer alice"}
    body = {"input": "Hi", "max_output_tokens": 3, "stream": True, "store": False}
    with httpx.stream(
        "POST", server.url("/v1/responses"), json=body, headers=headers, timeout=120
    ) as stream:
        lines = [line for line in stream.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[0::2]]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert len(names) == len(datas) and "[DONE]" not in lines[-1]
    assert names == [d["type"] for d in datas]


def test_text_format_json_schema_constrains_the_answer(alice: openai.OpenAI):
    schema = {
        "type": "object",
        "properties": {"sunny": {"type": "boolean"}},
        "required": ["sunny"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "forecast", "schema": schema, "strict": True}
    response = alice.responses.create(
        model=MODEL,
        input="Is it sunny in Paris? Answer in JSON.",
        text={"format": fmt},
        temperature=0,
        max_output_tokens=20,
    )
    assert response.status == "completed" and response.text.format.name == "forecast"
    jsonschema.validate(json.loads(response.output_text), schema)


# conversations --------------------------------------------------------------------------------------


def test_previous_response_id_continues_with_the_history_cached(alice: openai.OpenAI):
    questions = ["Tell me about cats.", "And dogs?", "Which is better?"]
    responses, previous = [], None
    for question in questions:
        response = alice.responses.create(
            model=MODEL,
            instructions="You are brief." if previous is None else None,
            input=question,
            previous_response_id=previous,
            temperature=0,
            max_output_tokens=8,
        )
        assert response.previous_response_id == previous
        responses.append(response)
        previous = response.id
    for before, after in itertools.pairwise(responses):
        history = before.usage.input_tokens + before.usage.output_tokens
        # the prompt holds the whole history, and every full block of it is a cache hit
        assert after.usage.input_tokens > history
        assert after.usage.input_tokens_details.cached_tokens >= history // BLOCK_SIZE * BLOCK_SIZE
    cached = [r.usage.input_tokens_details.cached_tokens for r in responses]
    assert cached[1] < cached[2]
    for response in responses:
        stored = alice.responses.retrieve(response.id)
        assert stored.output_text == response.output_text
        assert stored.previous_response_id == response.previous_response_id


def test_forced_function_call_validates_and_its_output_continues(alice: openai.OpenAI):
    response = forced_call(alice)
    assert response.status == "completed"
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    follow = alice.responses.create(
        model=MODEL,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}],
        tools=[
            WEATHER
        ],  # the same tools: the turn extends the stored tokens (other tools re-render)
        temperature=0,
        max_output_tokens=8,
    )
    assert follow.output and follow.previous_response_id == response.id
    history = response.usage.input_tokens + response.usage.output_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= history // BLOCK_SIZE * BLOCK_SIZE
    stored = alice.responses.retrieve(response.id)
    assert stored.output[0].call_id == call.call_id and stored.output[0].arguments == call.arguments
    (asked,) = alice.responses.input_items.list(response.id).data
    assert asked.type == "message" and asked.content[0].text == "What is the weather in Paris?"
    (result,) = alice.responses.input_items.list(follow.id, order="asc").data
    assert result.type == "function_call_output" and result.call_id == call.call_id
    assert result.output == "21 C, sunny"
    assert stored.tool_choice.name == "get_weather" and stored.tools[0].name == "get_weather"


def test_stream_helper_gives_the_function_call(alice: openai.OpenAI):
    with alice.responses.stream(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=40,
    ) as stream:
        fragments = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and "".join(fragments) == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert alice.responses.retrieve(final.id).output[0].call_id == call.call_id


@pytest.mark.parametrize("store", [False, True])
def test_history_resent_as_items(alice: openai.OpenAI, store: bool):
    """A client keeping the conversation itself: function_call and function_call_output items; stored, they are
    the response's input items, in order."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather"}
    response = alice.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {**call, "arguments": json.dumps({"city": "Paris"})},
            {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        ],
        tools=[WEATHER],
        store=store,
        temperature=0,
        max_output_tokens=6,
    )
    assert response.store is store and response.usage.output_tokens > 0
    if not store:
        with pytest.raises(openai.NotFoundError):
            alice.responses.retrieve(response.id)
        return
    items = alice.responses.input_items.list(response.id, order="asc").data
    assert [item.type for item in items] == ["message", "function_call", "function_call_output"]
    assert items[1].call_id == items[2].call_id == "call_1"
    assert json.loads(items[1].arguments) == {"city": "Paris"}
    newest_first = alice.responses.input_items.list(response.id).data
    assert [item.id for item in newest_first] == [item.id for item in reversed(items)]


def test_reasoning_is_its_own_item_streamed_stored_and_cached_after(qwen3: RunningServer):
    """Qwen3's template drops a reply's reasoning from the next prompt: the next response still extends the
    previous prompt (its blocks cached), and the reasoning is an item, never output text."""
    client = make_client(qwen3, "x")
    model = httpx.get(qwen3.url("/v1/models"), timeout=10).json()["data"][0]["id"]
    # the model is random: the bias makes it think
    think = {"logit_bias": {str(TOKEN_IDS["<think>"]): 100}}
    ask = {"model": model, "temperature": 0, "max_output_tokens": 8}
    rules = " ".join(f"Rule {i}: answer about topic {i} briefly." for i in range(8))
    first = {**ask, "input": "Why is the sky blue?", "instructions": rules}
    events = list(client.responses.create(**first, stream=True, extra_body=think))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    final = events[-1].response
    assert reasoning and final.output[0].type == "reasoning"
    assert final.output[0].content[0].text == reasoning and "<think>" not in final.output_text
    stored = client.responses.retrieve(final.id)
    assert stored.output[0].content[0].text == reasoning
    follow = client.responses.create(
        **{**ask, "input": "And at sunset?"}, previous_response_id=final.id
    )
    cached = follow.usage.input_tokens_details.cached_tokens
    assert cached >= final.usage.input_tokens // BLOCK_SIZE * BLOCK_SIZE > 0
    assert "re-rendering the whole conversation" not in qwen3.log()


# tenancy and bad input ------------------------------------------------------------------------------


def test_another_key_cannot_see_or_continue_a_response(
    server: RunningServer, alice: openai.OpenAI, bob: openai.OpenAI
):
    response = alice.responses.create(model=MODEL, input="A secret.", max_output_tokens=3)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(response.id)
    body = {"input": "Go on.", "previous_response_id": response.id, "max_output_tokens": 3}
    assert_error(post(server, body, key="bob"), 404, "previous_response_id")
    assert alice.responses.retrieve(response.id).id == response.id


def test_only_the_latest_response_continues(server: RunningServer, alice: openai.OpenAI):
    first = alice.responses.create(
        model=MODEL, input="One.", instructions="Be brief.", max_output_tokens=3
    )
    second = alice.responses.create(
        model=MODEL, input="Two.", previous_response_id=first.id, max_output_tokens=3
    )
    older = {"input": "Three.", "previous_response_id": first.id, "max_output_tokens": 3}
    assert "not the latest" in assert_error(post(server, older), 400, "previous_response_id")
    other = {"input": "x", "previous_response_id": second.id, "instructions": "Be long."}
    assert_error(post(server, other), 400, "instructions")


def test_a_response_still_streaming_cannot_be_continued_yet(server: RunningServer):
    """Its turn holds the session from response.created until its last event; then it continues. (The reply's 64
    tokens take the engine 64 steps; the refusal needs none.)"""
    headers = {"Authorization": "Bearer alice"}
    body = {"input": "Count to five.", "max_output_tokens": 64, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", server.url("/v1/responses"), json=body, headers=headers, timeout=120
    ) as stream:
        lines = stream.iter_lines()
        created = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        follow = {"input": "Go on.", "previous_response_id": created["response"]["id"]}
        early = post(server, {**follow, "max_output_tokens": 2})
        assert early.status_code == 409, early.text
        assert early.json()["error"]["code"] == "session_busy"
        rest = [line for line in lines if line.startswith("event: ")]
    assert rest[-1] in ("event: response.completed", "event: response.incomplete")
    assert post(server, {**follow, "max_output_tokens": 2}).status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (
            {"input": "x", "previous_response_id": "resp_" + "A" * 22 + "0001"},
            404,
            "previous_response_id",
        ),
        ({"input": "x", "previous_response_id": "nonsense"}, 404, "previous_response_id"),
        ({"input": [{"type": "image_generation_call"}]}, 400, "input.0.type"),
        ({"input": "x", "temperature": 3}, 400, "temperature"),
        ({"input": "x", "max_output_tokens": 10**6}, 400, "max_output_tokens"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, 400, "input.0.output"),
        ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
        ({"input": [{"role": "assistant", "content": "Hi"}]}, 400, "input"),
        (
            {"input": "x", "tools": [WEATHER], "text": {"format": {"type": "json_object"}}},
            400,
            "text.format",
        ),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
    ],
    ids=[
        "unknown_previous",
        "malformed_previous",
        "unknown_item_type",
        "temperature",
        "max_output_tokens",
        "item_without_output",
        "required_without_tools",
        "no_user_message",
        "text_format_with_tools",
        "unknown_text_format",
    ],
)
def test_bad_request_names_the_field(server: RunningServer, body: dict, status: int, param: str):
    assert_error(post(server, body), status, param)


def test_a_refused_first_response_leaves_no_session(server: RunningServer):
    """Checked once its session exists (the prompt's length): the session goes with the refusal."""
    headers = {"Authorization": "Bearer bob"}
    before = httpx.get(server.url("/v1/sessions"), headers=headers, timeout=10).json()["data"]
    assert_error(
        post(server, {"input": "x", "max_output_tokens": 10**6}, key="bob"),
        400,
        "max_output_tokens",
    )
    after = httpx.get(server.url("/v1/sessions"), headers=headers, timeout=10).json()["data"]
    assert after == before


def test_get_unknown_response_is_not_found(server: RunningServer):
    response = httpx.get(
        server.url("/v1/responses/resp_nothing"), headers={"Authorization": "Bearer alice"}
    )
    assert response.status_code == 404 and response.json()["error"]["param"] == "response_id"
