"""The bodies of /v1/sessions (a session, its title, a turn's message) and /v1/presets."""

from __future__ import annotations

from typing import Annotated

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

    @model_validator(mode="after")
    def _one_system(self) -> CreateSessionRequest:
        if self.system is not None and self.preset is not None:
            raise ValueError("preset: give a system prompt or a preset, not both")
        return self


class UpdateSessionRequest(RequestModel):
    title: Annotated[str, Field(min_length=1, max_length=200)]


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
