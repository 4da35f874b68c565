"""The Responses API's streamed events, without a model: a reply's parts (reasoning, text, two function calls) as
events that the official ``openai`` client validates against its own types and accumulates into the same
response as the one a non-streamed request (or a GET) builds from the whole reply."""

from __future__ import annotations

import json
import typing

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from app.chat_format.reply_parser import ReplyDelta, ToolCallDelta
from app.protocol.responses import ResponseRequest
from app.responses import objects
from app.responses.events import ResponseEvents
from app.responses.objects import ReplyParts, ResponseRef

REF = ResponseRef("A" * 22, 3)
# the client's event classes by their type (its union carries a discriminator its validator does not use)
EVENT_TYPES = {
    typing.get_args(member.model_fields["type"].annotation)[0]: member
    for member in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}
TOOLS = [{"type": "function", "name": "add", "parameters": {"type": "object"}}]
CALLS = [("call_1", "add", ['{"a": ', "1}"]), ("call_2", "add", ['{"a": 2}'])]


def reply_deltas() -> list[ReplyDelta]:
    """Reasoning in two pieces, the answer in two, then each call's name and argument fragments."""
    deltas = [
        ReplyDelta(reasoning="Add "),
        ReplyDelta(reasoning="them."),
        ReplyDelta(content="Sure"),
    ]
    deltas.append(ReplyDelta(content=", calling."))
    for number, (call_id, name, fragments) in enumerate(CALLS):
        deltas.append(ReplyDelta(tool_calls=[ToolCallDelta(number, "", call_id, name)]))
        deltas += [ReplyDelta(tool_calls=[ToolCallDelta(number, piece)]) for piece in fragments]
    return deltas


def whole_reply(finish_reason: str) -> ReplyParts:
    calls = [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": "".join(parts)}}
        for call_id, name, parts in CALLS
    ]
    return ReplyParts("Sure, calling.", "Add them.", calls, finish_reason, 30, 12, 16)


def streamed(finish_reason: str) -> list[dict]:
    body = ResponseRequest.model_validate({"input": "Add 1 and 2.", "tools": TOOLS})
    response = objects.response_object(
        REF.id, 1.0, "m", objects.request_settings(body), ResponseRef(REF.session_id, 2).id
    )
    events = ResponseEvents(response, REF.suffix)
    out = events.start()
    for delta in reply_deltas():
        out += events.feed(delta)
    # (through JSON, as the client reads them)
    return json.loads(json.dumps(out + events.finish(whole_reply(finish_reason))))


@pytest.mark.parametrize(
    ("finish_reason", "last"),
    [("tool_calls", "response.completed"), ("length", "response.incomplete")],
)
def test_events_are_the_clients_types_in_order(finish_reason: str, last: str):
    events = streamed(finish_reason)
    parsed = [EVENT_TYPES[event["type"]].model_validate(event) for event in events]
    assert [e.sequence_number for e in parsed] == list(range(len(events)))
    kinds = [e.type for e in parsed]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == last
    # reasoning ends before the answer begins; each call's arguments end before the next call
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    done = [e for e in parsed if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == ['{"a": 1}', '{"a": 2}']
    added = [e.output_index for e in parsed if e.type == "response.output_item.added"]
    finished = [e.output_index for e in parsed if e.type == "response.output_item.done"]
    assert sorted(added) == sorted(finished) == [0, 1, 2, 3]


def test_client_accumulates_the_stream_into_the_whole_response():
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in streamed("tool_calls"):
        state.handle_event(EVENT_TYPES[event["type"]].model_validate(event))
    final = state._completed_response
    assert final is not None and final.status == "completed"
    assert final.output_text == "Sure, calling."
    reasoning, message, *calls = final.output
    assert reasoning.content[0].text == "Add them." and message.type == "message"
    assert [(c.call_id, c.arguments) for c in calls] == [
        ("call_1", '{"a": 1}'),
        ("call_2", '{"a": 2}'),
    ]
    assert final.usage.input_tokens_details.cached_tokens == 16 and final.usage.total_tokens == 42


def test_streamed_output_equals_the_whole_replys():
    """What a GET (or a non-streamed request) builds from the stored reply is what the stream ended with."""
    final = streamed("tool_calls")[-1]["response"]
    assert final["output"] == objects.output_items(REF.suffix, whole_reply("tool_calls"))


def test_response_ids_name_session_and_turn():
    assert ResponseRef.parse(REF.id) == REF
    assert ResponseRef.parse(ResponseRef("b-_" * 7 + "c", 70000).id).turn == 70000
    for bad in ("resp_" + "A" * 22 + "0000", "resp_short0001", "msg_" + "A" * 22 + "0001"):
        assert ResponseRef.parse(bad) is None
