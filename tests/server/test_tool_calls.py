"""Tool calling with the official ``openai`` client, OpenAI's shapes exactly, against the default model (whose
template knows no tools: the server describes them in the system message and constrains the calls with the Hermes
syntax as text): required, a named function, parallel or not, streamed (a call's id and name first, then argument
fragments) and not, a second turn with the tool's result, none; and the 400s for choices the tools cannot meet."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server_harness import RunningServer, server_fixture

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

server = server_fixture()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.openai_base_url, api_key="not-needed", max_retries=0, timeout=120
    )


def _create(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=kwargs.pop("messages", ASK), temperature=0, **kwargs
    )


def _schema(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_required_gives_a_call_whose_arguments_parse_and_validate(client: openai.OpenAI):
    reply = _create(
        client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in {"get_weather", "get_time"}
    jsonschema.validate(json.loads(call.function.arguments), _schema(call.function.name))


def test_a_named_function_is_the_one_called(client: openai.OpenAI):
    choice = {"type": "function", "function": {"name": "get_time"}}
    reply = _create(client, tools=TOOLS, tool_choice=choice, max_tokens=60)
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), _schema("get_time"))
    assert reply.choices[0].finish_reason == "tool_calls"


def test_parallel_calls_each_parse_and_streamed_fragments_add_up_to_them(client: openai.OpenAI):
    whole = _create(client, tools=TOOLS, tool_choice="required", max_tokens=90)
    calls = whole.choices[0].message.tool_calls
    assert len(calls) >= 2  # (this model lists a call per tool when it may)
    assert len({c.id for c in calls}) == len(calls)
    chunks = list(_create(client, tools=TOOLS, tool_choice="required", max_tokens=90, stream=True))
    streamed: dict[int, dict] = {}
    for chunk in chunks:
        for part in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if part.index not in streamed:  # a call's first fragment: its id, type and name
                assert part.id and part.type == "function" and part.function.name
                streamed[part.index] = {"name": part.function.name, "arguments": ""}
            else:
                assert part.id is None and part.function.name is None
            streamed[part.index]["arguments"] += part.function.arguments or ""
    assert [(s["name"], s["arguments"]) for _, s in sorted(streamed.items())] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    for call in calls[:-1] if whole.choices[0].finish_reason == "length" else calls:
        jsonschema.validate(json.loads(call.function.arguments), _schema(call.function.name))


def test_a_second_turn_with_the_tool_result_answers_in_text(client: openai.OpenAI):
    first = _create(
        client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'},
    ]
    second = _create(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=12)
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].message.content
    # the call (written as the model wrote it: this template knows no tool calls) and the result are in the
    # prompt, each more than a dozen tokens
    asked = _create(client, max_tokens=1).usage.prompt_tokens
    assert second.usage.prompt_tokens > asked + 30


def test_tool_choice_none_renders_no_tools_and_calls_nothing(client: openai.OpenAI):
    plain = _create(client, max_tokens=8)
    none = _create(client, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
                ]
            },
            "tools",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [*ASK, {"role": "tool", "content": "21"}]}, "messages"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"x": {"type": "nonsense"}},
                            },
                        },
                    }
                ]
            },
            "tools",
        ),
    ],
)
def test_choices_the_tools_cannot_meet_are_a_400_naming_the_field(
    server: RunningServer, change: dict, field: str
):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 4, **change}
    body = {k: v for k, v in body.items() if v is not None}
    response = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] is not None and error["param"].startswith(field), error
