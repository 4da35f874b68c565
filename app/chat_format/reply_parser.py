"""A reply's text split as it streams into reasoning, content and tool calls (OpenAI's ``reasoning_content``,
``content`` and ``tool_calls`` with argument fragments).

The grammar (tool_grammar.py) makes a call's layout certain — ``{"name": "f", "arguments": {...}}`` in the
syntax's wrapping — so the parser streams the function's name as soon as it is complete and then the arguments'
JSON text as it arrives, without waiting for the call's end. Text that may be the start of a marker (``</thi``) is
held back until the next fragment says what it is.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from dataclasses import dataclass, field

from app.chat_format.formats import ChatFormat

_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
)
_ALNUM = string.ascii_letters + string.digits


@dataclass(slots=True)
class ToolCallDelta:
    index: int
    arguments: str
    id: str | None = None  # with the name, on a call's first fragment
    name: str | None = None

    def chunk(self) -> dict:
        """OpenAI's ``delta.tool_calls[i]``."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ReplyDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str = ""

    def message_call(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def call_id(fmt: ChatFormat, seed: str, number: int) -> str:
    """The id of a reply's call ``number``, derived from the reply's ``seed`` (its request id and choice), so a
    reply parsed twice (streamed, then stored with its session) names its calls the same. Mistral's templates
    take 9 letters and digits; others OpenAI's ``call_`` ids."""
    digest = hashlib.sha256(f"{seed}:{number}".encode()).digest()
    if fmt.tools.name == "mistral":
        return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:9])
    return f"call_{digest[:12].hex()}"


class ReplyParser:
    def __init__(
        self, fmt: ChatFormat, parse_tools: bool, reasoning_open: bool = False, seed: str = ""
    ) -> None:
        """``parse_tools``: the request offered tools (tool_choice not none); ``reasoning_open``: the prompt ends
        inside the model's reasoning (its generation prompt opened ``<think>``); ``seed``: what the calls' ids
        derive from (call_id)."""
        self._fmt = fmt
        self._seed = seed
        self._tools = parse_tools
        self._stage = "reasoning" if reasoning_open and fmt.reasoning else "start"
        self._pending = ""  # text not yet given to a stage
        self._trim_content = False  # drop the newlines between the reasoning's end and the answer
        self.calls: list[ParsedCall] = []
        self.content = ""
        self.reasoning = ""
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._open = False  # a call's arguments are being read

    def feed(self, text: str, final: bool = False) -> ReplyDelta:
        out = ReplyDelta()
        self._pending += text
        while True:
            stage = self._stage
            getattr(self, f"_{stage}")(out, final)
            if self._stage == stage:
                break
        self.content += out.content
        self.reasoning += out.reasoning
        return out

    def finish(self) -> ReplyDelta:
        """What is still held back, once the reply has ended."""
        return self.feed("", final=True)

    # stages: each consumes what it can of _pending and may move to the next ---------------------------

    def _start(self, out: ReplyDelta, final: bool) -> None:
        if self._fmt.reasoning is None:
            self._stage = "content"
            return
        opener = self._fmt.reasoning[0]
        text = self._pending.lstrip()
        if text.startswith(opener):
            self._pending = text[len(opener) :].lstrip("\n")
            self._stage = "reasoning"
        elif final or not opener.startswith(text):
            self._stage = "content"

    def _reasoning(self, out: ReplyDelta, final: bool) -> None:
        closer = self._fmt.reasoning[1]
        if not self.reasoning and not out.reasoning:  # (the newline after <think>)
            self._pending = self._pending.lstrip("\n")
        end = self._pending.find(closer)
        if end >= 0:
            out.reasoning += self._pending[:end].rstrip("\n")
            self._pending = self._pending[end + len(closer) :]
            self._trim_content = True
            self._stage = "content"
            return
        keep = 0 if final else _held(self._pending, closer, keep_newlines=True)
        out.reasoning += self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]

    def _content(self, out: ReplyDelta, final: bool) -> None:
        if self._trim_content:
            self._pending = self._pending.lstrip("\n")
            if not self._pending and not final:
                return
            self._trim_content = False
        if not self._tools:
            out.content += self._pending
            self._pending = ""
            return
        syntax = self._fmt.tools
        if syntax.name == "llama3_json":  # a reply that starts with "{" is a call
            if not self.content and not out.content and self._pending.lstrip().startswith("{"):
                self._stage = "calls"
            elif self._pending.strip() or final:
                out.content += self._pending
                self._pending = ""
            return
        trigger = syntax.opener.strip()
        at = self._pending.find(trigger)
        if at >= 0:
            out.content += self._pending[:at]
            self._pending = self._pending[at + len(trigger) :]
            self._stage = "calls"
            return
        keep = 0 if final else _held(self._pending, trigger)
        out.content += self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]

    def _calls(self, out: ReplyDelta, final: bool) -> None:
        while self._pending:
            if not self._open:
                start = self._pending.find("{")
                if start < 0:
                    self._pending = (
                        ""  # wrapping between calls ("\n</tool_call>\n<tool_call>\n", ", ", "]")
                    )
                    return
                head = _HEAD.match(self._pending, start)
                if head is None:
                    self._pending = self._pending[start:]
                    return
                name = json.loads(f'"{head.group(1)}"')
                call = ParsedCall(call_id(self._fmt, self._seed, len(self.calls)), name)
                self.calls.append(call)
                out.tool_calls.append(ToolCallDelta(len(self.calls) - 1, "", call.id, name))
                self._pending = self._pending[head.end() :]
                self._open = True
            taken = self._scan_arguments()
            piece, self._pending = self._pending[:taken], self._pending[taken:]
            if piece:
                self.calls[-1].arguments += piece
                _append_arguments(out, len(self.calls) - 1, piece)
            if self._open:
                return  # the arguments go on in the next fragment

    def _scan_arguments(self) -> int:
        """How many characters of _pending belong to the open call's arguments; closes the call at their end."""
        for i, char in enumerate(self._pending):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                continue
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self._depth, self._open = 0, False
                    return i + 1
        return len(self._pending)


def _append_arguments(out: ReplyDelta, index: int, piece: str) -> None:
    last = out.tool_calls[-1] if out.tool_calls else None
    if last is not None and last.index == index:
        last.arguments += piece
    else:
        out.tool_calls.append(ToolCallDelta(index, piece))


def _held(text: str, marker: str, keep_newlines: bool = False) -> int:
    """How many characters at the end of ``text`` to hold back: the longest tail that starts ``marker`` (and,
    with ``keep_newlines``, trailing newlines, which belong to the reasoning only if more text follows)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size + (
                len(text[:-size]) - len(text[:-size].rstrip("\n")) if keep_newlines else 0
            )
    return len(text) - len(text.rstrip("\n")) if keep_newlines else 0
