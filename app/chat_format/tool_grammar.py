"""The grammar that makes a reply's tool calls well-formed by construction: an llguidance Lark grammar built from
the model's tool-call syntax (formats.py) and each function's parameter schema (embedded with ``%json``).

- ``required``: the reply is one or more calls (one with ``parallel_tool_calls: false``);
- a named function: the reply is exactly one call of it;
- ``auto``: free text, and once the model writes the syntax's trigger (``<tool_call>``, ``[TOOL_CALLS]``, or for
  Llama 3 JSON a reply that starts with ``{``) the rest is calls: a lazily triggered grammar. Text cannot follow a
  call.

A reasoning model may think first: ``<think> ... </think>`` is allowed (or, when the prompt already opened it, is
required) before the answer; the reasoning itself is free.
"""

from __future__ import annotations

import json
from typing import Any

from app.chat_format.formats import ChatFormat
from app.protocol.tools import Tool

# one fixed layout (as for response_format): arguments the parser can stream, no runs of blank lines
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY = r"/(.|\n)*/"


def tool_call_grammar(
    fmt: ChatFormat,
    tools: list[Tool],
    choice: str,
    parallel: bool,
    reasoning_open: bool = False,
) -> str:
    """The Lark grammar for ``choice`` ("auto", "required", or a function's name); ``reasoning_open``: the
    prompt ends inside the model's reasoning (its generation prompt opened ``<think>``)."""
    if choice not in ("auto", "required"):
        tools = [t for t in tools if t.function.name == choice]
        parallel = False
    syntax = fmt.tools
    parallel = parallel and syntax.parallel
    body = _call_body(tools, syntax.arguments_key)
    opener, closer = _piece(fmt, syntax.opener), _piece(fmt, syntax.closer)
    lines = ["%llguidance {}", f"call_body: %json {body}"]
    if syntax.name == "mistral":
        more = f' ("{_esc(syntax.separator)}" call_body)*' if parallel else ""
        lines.append(f'calls: {opener} "[" call_body{more} {closer}')
    else:
        lines.append(f"call: {opener} call_body {closer}".replace("  ", " "))
        more = f' ("{_esc(syntax.separator)}" call)*' if parallel and syntax.separator else ""
        lines.append(f"calls: call{more}")
    if choice != "auto":
        lines.append("answer: calls")
    else:
        lines.extend(_auto(fmt, parallel))
    lines.extend(_reasoning(fmt, reasoning_open))
    return "\n".join(lines) + "\n"


def _auto(fmt: ChatFormat, parallel: bool) -> list[str]:
    """Free text, or text then calls once the trigger appears."""
    syntax = fmt.tools
    if syntax.name == "llama3_json":  # a reply that starts with "{" is a call
        return ["answer: TEXT | calls", r"TEXT: /([^{ \n](.|\n)*)?/"]
    trigger = syntax.opener.strip()
    if trigger in fmt.marker_ids:  # a token: free text cannot contain it
        return ["answer: TEXT | TEXT? calls", r"TEXT: /(.|\n)+/"]
    # a text trigger: the text before it is lazy (it ends where the trigger first appears), and text without
    # a call never contains the trigger
    never = f"~/(?s:.*){_regex(trigger)}(?s:.*)/"
    rest = syntax.opener[syntax.opener.index(trigger) + len(trigger) :]  # ("\n" for hermes)
    head = f'"{_esc(rest)}" ' if rest else ""
    closer = _piece(fmt, syntax.closer)
    sep = _esc(syntax.separator)
    if syntax.name == "mistral":
        more = f' ("{sep}" call_body)*' if parallel else ""
        first = f'{head}"[" call_body{more} {closer}'
    else:
        more = f' ("{sep}" call)*' if parallel else ""
        first = f"{head}call_body {closer}{more}"
    return [
        "answer: TEXT | lead after_trigger",
        f"TEXT: {_ANY} & {never}",
        f"lead[lazy]: /(.|\\n)*{_regex(trigger)}/",
        f"after_trigger: {first}",
    ]


def _reasoning(fmt: ChatFormat, reasoning_open: bool) -> list[str]:
    """The reasoning before the answer, and the blank lines templates write after its end (``</think>\n\n``)."""
    if fmt.reasoning is None:
        return ["start: answer"]
    start, end = (_piece(fmt, m) for m in fmt.reasoning)
    tokens = start.startswith("<[") and end.startswith("<[")
    if tokens:
        thought = [f"THINK: {_ANY}"]
        closed = f"THINK {end} GAP?"
    else:  # (text markers: the reasoning is lazy, it ends at the closing marker's first occurrence)
        thought = [f"thought[lazy]: /(.|\\n)*{_regex(fmt.reasoning[1])}/"]
        closed = "thought GAP?"
    gap = [r"GAP: /[ \t\n]+/"]
    if reasoning_open:
        return [f"start: {closed} answer", *thought, *gap]
    return [f"start: ({start} {closed})? answer", *thought, *gap]


def _call_body(tools: list[Tool], arguments_key: str) -> str:
    """One call's JSON: the function's name, then its arguments (in that order, so names stream first)."""
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                arguments_key: closed(tool.function.parameters_schema())
                if tool.function.strict is not False
                else tool.function.parameters_schema(),
            },
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return json.dumps({"x-guidance": _LAYOUT, "anyOf": variants}, ensure_ascii=True)


_NESTED = ("properties", "$defs", "definitions", "patternProperties")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on each object that lists its properties and says nothing
    of others (OpenAI's strict mode): a call's arguments are the ones its function names, not inventions."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _NESTED:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in _LISTS:
        if isinstance(out.get(key), list):
            out[key] = closed(out[key])
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _piece(fmt: ChatFormat, text: str) -> str:
    """``text`` in a rule: a token reference for a single-token marker (with any newline around it kept as text),
    else a string literal; "" for nothing."""
    if not text:
        return ""
    marker = text.strip()
    if marker in fmt.marker_ids:
        before, after = text.split(marker, 1)
        parts = [f'"{_esc(before)}"' if before else "", f"<[{fmt.marker_ids[marker]}]>"]
        parts.append(f'"{_esc(after)}"' if after else "")
        return " ".join(p for p in parts if p)
    return f'"{_esc(text)}"'


def _esc(text: str) -> str:
    return json.dumps(text)[1:-1]


def _regex(text: str) -> str:
    """``text`` as a literal inside /.../ (punctuation as hex escapes: ``\\<`` is a word boundary there)."""
    return "".join(
        c if c.isascii() and (c.isalnum() or c == "_") else f"\\x{{{ord(c):x}}}" for c in text
    )
