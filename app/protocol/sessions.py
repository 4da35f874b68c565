"""The bodies of /v1/sessions (a session, its title, a turn's message) and /v1/presets."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from app.protocol.fields import NumSamples, RequestModel, Salt
from app.protocol.sampling import SamplingFields


class CreateSessionRequest(RequestModel):
    system: str | None = Field(default=None, description="system prompt (or use a preset)")
    preset: str | None = Field(
        default=None, description="name of a preset whose system prompt to use"
    )
    title: str | None = Field(default=None, max_length=200)
    cache_salt: Salt | None = Field(
        default=None,
        description="this session's prefix blocks are shared only with "
        "requests carrying the same salt",
    )
    source: Literal["ui", "api"] = Field(
        default="api", description="who starts it: the chat UI or an API client (a list filter)"
    )

    @model_validator(mode="after")
    def _one_system(self) -> CreateSessionRequest:
        if self.system is not None and self.preset is not None:
            raise ValueError("preset: give a system prompt or a preset, not both")
        return self


class UpdateSessionRequest(RequestModel):
    title: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    pinned: bool | None = Field(default=None, description="pinned sessions are listed first")
    system: str | None = Field(
        default=None,
        description="a new system prompt (null: none); it also clears the session's preset, and the next "
        "turn renders the whole conversation again with it (409 while a turn is answered)",
    )

    @property
    def changes_system(self) -> bool:
        """``system`` was given, null included (null clears the system prompt)."""
        return "system" in self.model_fields_set

    @model_validator(mode="after")
    def _something(self) -> UpdateSessionRequest:
        if self.title is None and self.pinned is None and not self.changes_system:
            raise ValueError("title: give a new title, pinned or system")
        return self


class ForkSessionRequest(RequestModel):
    turn: Annotated[int, Field(ge=0)] = Field(
        description="keep the first `turn` turns (a turn: a user message and the replies after it)"
    )


class SessionMessageRequest(SamplingFields):
    # the schema says what the validator below checks: content, or regenerate=true without content
    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {
                    "required": ["content"],
                    "properties": {"content": {"type": "string"}, "regenerate": {"const": False}},
                },
                {
                    "required": ["regenerate"],
                    "properties": {"regenerate": {"const": True}, "content": {"type": "null"}},
                },
            ]
        }
    )

    content: str | None = Field(default=None, description="the user's message")
    n: NumSamples = Field(
        default=1,
        json_schema_extra={"maximum": 1},
        description="a session turn stores one reply: only 1",
    )
    regenerate: bool = Field(
        default=False, description="drop the last reply and answer the last message again"
    )

    def prompt_field(self) -> str:
        return "content"

    @model_validator(mode="after")
    def _content_or_regenerate(self) -> SessionMessageRequest:
        if self.regenerate == (self.content is not None):
            raise ValueError(
                "content: give the message's content, or regenerate=true without content"
            )
        return self


class CreatePresetRequest(RequestModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
    system: Annotated[str, Field(min_length=1)]
    shared: bool = Field(
        default=False,
        description="every tenant sees it (admin key only); otherwise it is the creating key's own",
    )


class ImportedMessage(RequestModel):
    """A message of an exported session (its ``tokens`` and other fields are ignored)."""

    role: Literal["user", "assistant", "tool"]
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def stored(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class ImportSessionRequest(RequestModel):
    """What GET /v1/sessions/{id}/export?format=json gives (``object``, ``model``, ``created_at`` are ignored)."""

    version: Literal[1] = 1
    title: str | None = Field(default=None, max_length=200)
    system: str | None = None
    source: Literal["ui", "api"] = "api"
    messages: Annotated[list[ImportedMessage], Field(min_length=1, max_length=4096)]

    @model_validator(mode="after")
    def _turns(self) -> ImportSessionRequest:
        """User first, a reply last; each reply answers a user or tool message, and tool results follow a reply
        that called tools."""
        roles = [m.role for m in self.messages]
        if roles[0] != "user" or roles[-1] != "assistant":
            raise ValueError("messages: must start with a user message and end with a reply")
        for i, (before, message) in enumerate(zip(self.messages, self.messages[1:]), 1):
            if message.role == "assistant" and before.role == "assistant":
                raise ValueError(f"messages: message {i} is a reply that follows a reply")
            if message.role == "tool" and not (before.role == "tool" or before.tool_calls):
                raise ValueError(f"messages: message {i} is a tool result without a tool call")
        for i, message in enumerate(self.messages):
            if message.role != "assistant" and message.content is None:
                raise ValueError(f"messages: message {i} ({message.role}) has no content")
            if not all(_is_call(call) for call in message.tool_calls or []):
                raise ValueError(
                    f"messages: message {i}'s tool_calls need function.name and "
                    "function.arguments strings"
                )
        return self


def _is_call(call: dict[str, Any]) -> bool:
    function = call.get("function")
    return (
        isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and isinstance(function.get("arguments"), str)
    )
