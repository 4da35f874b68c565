"""What a chat request's tools and reasoning settings mean for its prompt and its reply: the tools the template
renders (or a system message of ours for a template that knows none), the template's reasoning switches, the
grammar that constrains the calls, and how the reply's text is split (ReplyPlan)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from app.chat_format.formats import ChatFormat
from app.chat_format.reply_parser import ReplyParser
from app.chat_format.reply_parser import call_id as reply_call_id
from app.chat_format.tool_grammar import tool_call_grammar
from app.protocol.tools import NamedToolChoice, Tool
from engine.sampling_params import StructuredOutput

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


@dataclass(frozen=True, slots=True)
class ToolUse:
    """A request's tools and its choice: "none", "auto", "required" or a function's name."""

    tools: list[Tool] = field(default_factory=list)
    choice: str = "none"
    parallel: bool = True

    @classmethod
    def of(
        cls, tools: list[Tool] | None, choice: str | NamedToolChoice | None, parallel: bool | None
    ) -> ToolUse:
        """ValueError naming the field for a choice the tools cannot meet."""
        tools = tools or []
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions have the same name")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise ValueError(
                    f"tool_choice: no function named {choice.function.name!r} in tools"
                )
            choice = choice.function.name
        elif choice is None:  # OpenAI's default: auto with tools, none without
            choice = "auto" if tools else "none"
        if choice != "none" and not tools:
            raise ValueError(f"tool_choice: {choice!r} needs tools")
        return cls(tools, choice, True if parallel is None else parallel)

    @property
    def active(self) -> bool:
        return self.choice != "none"


@dataclass(frozen=True, slots=True)
class ReplyPlan:
    fmt: ChatFormat
    parse_tools: bool = False
    reasoning_open: bool = False  # the prompt ends inside the model's reasoning

    def parser(self, seed: str) -> ReplyParser:
        """A parser for one reply; ``seed``: its request id and choice index (the calls' ids derive from it)."""
        return ReplyParser(self.fmt, self.parse_tools, self.reasoning_open, seed)


def template_kwargs(
    fmt: ChatFormat,
    template: str | None,
    use: ToolUse,
    effort: str | None,
    given: dict[str, Any] | None,
) -> dict[str, Any]:
    """The chat template's variables: the request's own, the tools (when the template renders them), and the
    reasoning switches (Qwen3's ``enable_thinking`` follows ``reasoning_effort`` unless set explicitly)."""
    kwargs = dict(given or {})
    if use.active and fmt.renders_tools:
        kwargs["tools"] = [t.template_tool() for t in use.tools]
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
        if template and "enable_thinking" in template:
            kwargs.setdefault("enable_thinking", effort not in ("none", "minimal"))
    return kwargs


@dataclass(frozen=True, slots=True)
class ChatSetup:
    """A chat request's tools and the template's variables: what its prompt renders with."""

    use: ToolUse
    kwargs: dict[str, Any]
    # the tools and their syntax, said in the system message (a template that renders no tools)
    instructions: str | None = None


def chat_setup(
    fmt: ChatFormat | None,
    template: str | None,
    use: ToolUse,
    effort: str | None,
    given: dict[str, Any] | None,
) -> ChatSetup:
    if fmt is None:
        return ChatSetup(use, dict(given or {}))
    return ChatSetup(
        use, template_kwargs(fmt, template, use, effort, given), tool_instructions(fmt, use)
    )


def tool_instructions(fmt: ChatFormat, use: ToolUse) -> str | None:
    """For a template that does not render tools: the tools and the call syntax, for the system message."""
    if not use.active or fmt.renders_tools:
        return None
    syntax = fmt.tools
    example = f'{{"name": <function name>, "{syntax.arguments_key}": <arguments as a JSON object>}}'
    how = {
        "hermes": f"write each call as <tool_call>\n{example}\n</tool_call>",
        "llama3_json": f"answer with only {example}",
        "mistral": f"write [TOOL_CALLS][{example}, ...]",
    }[syntax.name]
    listed = "\n".join(json.dumps(t.template_tool()["function"]) for t in use.tools)
    return f"You can call these functions. To call one, {how}.\nFunctions:\n{listed}"


_MISTRAL_ID = re.compile(r"^[A-Za-z0-9]{9}$")


def template_ids(fmt: ChatFormat, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Call ids as the template takes them: Mistral's templates refuse any but 9 letters and digits, so another
    client's ids (``call_...``) are mapped to such ids, the same for a call and its result."""
    if fmt.tools.name != "mistral":
        return messages

    def fit(call_id: str) -> str:
        return call_id if _MISTRAL_ID.match(call_id) else reply_call_id(fmt, call_id, 0)

    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [{**c, "id": fit(c.get("id") or "")} for c in message["tool_calls"]]
            message = {**message, "tool_calls": calls}
        if message.get("tool_call_id"):
            message = {**message, "tool_call_id": fit(message["tool_call_id"])}
        out.append(message)
    return out


def calls_as_text(fmt: ChatFormat, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template that knows no tool calls: each assistant message's calls written into its content in the
    format's syntax (what the model wrote), so the history shows them."""
    if fmt.renders_tools or not any(m.get("tool_calls") for m in messages):
        return template_ids(fmt, messages)
    syntax = fmt.tools
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls:
            out.append(message)
            continue
        bodies = [
            json.dumps(
                {"name": c["function"]["name"], syntax.arguments_key: c["function"]["arguments"]},
                ensure_ascii=False,
            )
            for c in calls
        ]
        if syntax.name == "mistral":
            text = f"{syntax.opener}[{syntax.separator.join(bodies)}{syntax.closer}"
        else:
            text = syntax.separator.join(f"{syntax.opener}{b}{syntax.closer}" for b in bodies)
        plain = {k: v for k, v in message.items() if k != "tool_calls"}
        plain["content"] = (message.get("content") or "") + text
        out.append(plain)
    return out


def with_instructions(setup: ChatSetup, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the setup's tool instructions at the end of the system message (or as one)."""
    text = setup.instructions
    if text is None:
        return messages
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def opens_reasoning(fmt: ChatFormat, prompt_text: str) -> bool:
    """The generation prompt ends inside the reasoning (DeepSeek-R1's templates open ``<think>``)."""
    return fmt.reasoning is not None and prompt_text.rstrip().endswith(fmt.reasoning[0])


def tool_grammar_spec(fmt: ChatFormat, use: ToolUse, reasoning_open: bool) -> StructuredOutput:
    return StructuredOutput(
        "lark", schema=tool_call_grammar(fmt, use.tools, use.choice, use.parallel, reasoning_open)
    )


def needs_special_tokens(fmt: ChatFormat, use: ToolUse) -> bool:
    """The call trigger is a special token the detokenizer would hide (Mistral's ``[TOOL_CALLS]``)."""
    return use.active and fmt.marker_is_special(fmt.tools.opener.strip())
