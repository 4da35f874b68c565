"""The streamed events of one response (OpenAI's Responses API): ``response.created`` and ``in_progress``; for each
output item ``output_item.added``, its content part, the text or argument deltas, their ``done`` events and
``output_item.done``; then ``response.completed`` (or ``incomplete`` / ``failed``) with the whole response. Each
event carries a ``sequence_number``.

Items open as the reply's parts arrive (reasoning, the message, each call) and their ``done`` events come when the
reply moves on: reasoning ends when the answer or a call begins, a call when the next begins, the message at the
end (text after the calls still belongs to it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.chat_format.reply_parser import ReplyDelta, ToolCallDelta
from app.responses import objects
from app.responses.objects import ReplyParts

_TERMINAL = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "cancelled": "response.incomplete",
    "failed": "response.failed",
}


@dataclass(slots=True)
class _Open:
    """An output item being streamed: its place in ``output`` and the text or arguments so far."""

    index: int
    item: dict[str, Any]
    text: str = ""


@dataclass(slots=True)
class ResponseEvents:
    response: dict[str, Any]  # the response in progress (objects.response_object)
    suffix: str  # what the items' ids derive from
    output: list[dict[str, Any]] = field(default_factory=list)
    _sequence: int = 0
    _reasoning: _Open | None = None
    _message: _Open | None = None
    _call: _Open | None = None
    _calls: int = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, **fields, "sequence_number": self._sequence}
        self._sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [
            self.event("response.created", response=self.response),
            self.event("response.in_progress", response=self.response),
        ]

    def feed(self, parts: ReplyDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if parts.reasoning:
            events += self._reasoning_delta(parts.reasoning)
        if parts.content:
            events += self._close_reasoning() + self._text_delta(parts.content)
        for call in parts.tool_calls:
            events += self._close_reasoning() + self._call_delta(call)
        return events

    def finish(self, parts: ReplyParts) -> list[dict[str, Any]]:
        """The open items' done events and the terminal event with the whole response."""
        status = objects.item_status(parts.finish_reason)
        events = self._close_reasoning(status) + self._close_call(status)
        if self._message is None and not self._calls:
            events += self._open_message()
        events += self._close_message(status)
        self.response = objects.finished(self.response, self.output, parts)
        kind = _TERMINAL[self.response["status"]]
        return [*events, self.event(kind, response=self.response)]

    # items --------------------------------------------------------------------------------------------

    def _add(self, item: dict[str, Any]) -> tuple[_Open, dict[str, Any]]:
        opened = _Open(len(self.output), item)
        self.output.append(item)
        # (a copy: the item grows after this event is written)
        added = self.event("response.output_item.added", output_index=opened.index, item=dict(item))
        return opened, added

    def _done(self, opened: _Open, status: str) -> dict[str, Any]:
        opened.item["status"] = status
        return self.event("response.output_item.done", output_index=opened.index, item=opened.item)

    def _content_event(self, kind: str, opened: _Open, **fields: Any) -> dict[str, Any]:
        """An event about the item's (only) content part."""
        return self.event(
            kind, item_id=opened.item["id"], output_index=opened.index, content_index=0, **fields
        )

    def _reasoning_delta(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._reasoning is None:
            item = objects.reasoning_item(f"rs_{self.suffix}", "", "in_progress")
            self._reasoning, added = self._add(item)
            part = {"type": "reasoning_text", "text": ""}
            events += [
                added,
                self._content_event("response.content_part.added", self._reasoning, part=part),
            ]
        self._reasoning.text += text
        return [
            *events,
            self._content_event("response.reasoning_text.delta", self._reasoning, delta=text),
        ]

    def _close_reasoning(self, status: str = "completed") -> list[dict[str, Any]]:
        opened, self._reasoning = self._reasoning, None
        if opened is None:
            return []
        part = {"type": "reasoning_text", "text": opened.text}
        opened.item["content"] = [part]
        return [
            self._content_event("response.reasoning_text.done", opened, text=opened.text),
            self._content_event("response.content_part.done", opened, part=part),
            self._done(opened, status),
        ]

    def _open_message(self) -> list[dict[str, Any]]:
        self._message, added = self._add(
            objects.message_item(f"msg_{self.suffix}", None, "in_progress")
        )
        part = objects.text_part("")
        return [added, self._content_event("response.content_part.added", self._message, part=part)]

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        events = self._open_message() if self._message is None else []
        self._message.text += text
        delta = self._content_event(
            "response.output_text.delta", self._message, delta=text, logprobs=[]
        )
        return [*events, delta]

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        opened = self._message
        if opened is None:
            return []
        part = objects.text_part(opened.text)
        opened.item["content"] = [part]
        return [
            self._content_event("response.output_text.done", opened, text=opened.text, logprobs=[]),
            self._content_event("response.content_part.done", opened, part=part),
            self._done(opened, status),
        ]

    def _call_delta(self, call: ToolCallDelta) -> list[dict[str, Any]]:
        events = []
        if call.id is not None:  # a new call: its name first
            events += self._close_call("completed")
            item_id = f"fc_{self.suffix}_{self._calls}"
            self._calls += 1
            item = objects.call_item(item_id, call.id, call.name or "", "", "in_progress")
            self._call, added = self._add(item)
            events.append(added)
        if call.arguments and self._call is not None:
            self._call.text += call.arguments
            self._call.item["arguments"] = self._call.text
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=self._call.item["id"],
                    output_index=self._call.index,
                    delta=call.arguments,
                )
            )
        return events

    def _close_call(self, status: str) -> list[dict[str, Any]]:
        opened, self._call = self._call, None
        if opened is None:
            return []
        done = self.event(
            "response.function_call_arguments.done",
            item_id=opened.item["id"],
            output_index=opened.index,
            name=opened.item["name"],
            arguments=opened.text,
        )
        return [done, self._done(opened, status)]
