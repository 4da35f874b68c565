"""Chat messages: a request's conversation (system, developer, user, assistant and tool messages; text parts
joined), and each message as the chat template takes it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from app.protocol.fields import RequestModel
from app.protocol.tools import MAX_TOOL_CALLS, ToolCall


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class _Message(RequestModel):
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def as_template_message(self) -> dict[str, Any]:
        """The chat template's view: developer messages are system messages (OpenAI's newer name)."""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}

    def as_stored_message(self) -> dict[str, Any]:
        """As a session keeps it: OpenAI's shape (a call's arguments as JSON text)."""
        return self.as_template_message()


class InputMessage(_Message):
    role: Literal["system", "developer", "user"]
    content: str | list[TextPart]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    reasoning_content: str | None = Field(
        default=None,
        description="the reply's reasoning (templates of reasoning models may drop it)",
    )

    def as_template_message(self) -> dict[str, Any]:
        message = super().as_template_message()
        if self.tool_calls:
            message["tool_calls"] = [call.template_call() for call in self.tool_calls]
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message

    def as_stored_message(self) -> dict[str, Any]:
        message = super().as_template_message()
        if self.tool_calls:
            message["tool_calls"] = [call.stored() for call in self.tool_calls]
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


class ToolMessage(_Message):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: Annotated[str, Field(min_length=1, max_length=64)]

    def as_template_message(self) -> dict[str, Any]:
        return {**super().as_template_message(), "tool_call_id": self.tool_call_id}


_ROLES = ("system", "developer", "user", "assistant", "tool")
_TAGS = {"assistant": "AssistantMessage", "tool": "ToolMessage"}


def _message_tag(value: Any) -> str | None:
    role = value.get("role") if isinstance(value, dict) else getattr(value, "role", None)
    if role not in _ROLES:
        return None
    return _TAGS.get(role, "InputMessage")


ChatMessage = Annotated[
    Annotated[InputMessage, Tag("InputMessage")]
    | Annotated[AssistantMessage, Tag("AssistantMessage")]
    | Annotated[ToolMessage, Tag("ToolMessage")],
    Discriminator(
        _message_tag,
        custom_error_type="invalid_role",
        custom_error_message=f"role: must be one of {', '.join(_ROLES)}",
    ),
]
