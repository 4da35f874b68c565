"""Chat messages: a request's conversation (system, developer, user and assistant messages; text parts joined)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Tag

from app.protocol.fields import RequestModel


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

    def as_template_message(self) -> dict[str, str]:
        """The chat template's view: developer messages are system messages (OpenAI's newer name)."""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}


class InputMessage(_Message):
    role: Literal["system", "developer", "user"]
    content: str | list[TextPart]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None


_ROLES = ("system", "developer", "user", "assistant")


def _message_tag(value: Any) -> str | None:
    role = value.get("role") if isinstance(value, dict) else getattr(value, "role", None)
    if role not in _ROLES:
        return None
    return "AssistantMessage" if role == "assistant" else "InputMessage"


ChatMessage = Annotated[
    Annotated[InputMessage, Tag("InputMessage")]
    | Annotated[AssistantMessage, Tag("AssistantMessage")],
    Discriminator(
        _message_tag,
        custom_error_type="invalid_role",
        custom_error_message=f"role: must be one of {', '.join(_ROLES)}",
    ),
]
