"""Tool calling in a request, OpenAI's shapes: ``tools`` (function schemas), ``tool_choice``, and the tool calls an
assistant message carries in the history."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from app.protocol.fields import RequestModel

MAX_TOOLS = 128  # OpenAI's limit on tools per request
MAX_TOOL_CALLS = 128  # calls one assistant message may carry
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDefinition(RequestModel):
    name: FunctionName
    description: str | None = Field(default=None, max_length=4096)
    parameters: dict[str, Any] | None = Field(
        default=None, description="a JSON Schema for the arguments (an object); none: no arguments"
    )
    strict: bool | None = Field(
        default=None, description="always enforced: a call's arguments follow the schema's grammar"
    )

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("must be a JSON Schema of an object (type: object)")
        return value

    def parameters_schema(self) -> dict[str, Any]:
        return (
            self.parameters
            if self.parameters is not None
            else {"type": "object", "properties": {}, "additionalProperties": False}
        )


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition

    def template_tool(self) -> dict[str, Any]:
        """The tool as chat templates take it (``tools=`` in apply_chat_template)."""
        function: dict[str, Any] = {
            "name": self.function.name,
            "parameters": self.function.parameters_schema(),
        }
        if self.function.description is not None:
            function["description"] = self.function.description
        return {"type": "function", "function": function}


class NamedFunction(RequestModel):
    name: FunctionName


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(RequestModel):
    name: FunctionName
    arguments: str = Field(description="the arguments as JSON text (an object)")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value) if value.strip() else {}
        except ValueError as exc:
            raise ValueError(f"must be JSON text: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError("must be a JSON object")  # noqa: TRY004 - pydantic reports ValueError
        return value


class ToolCall(RequestModel):
    id: Annotated[str, Field(min_length=1, max_length=64)]
    type: Literal["function"] = "function"
    function: CalledFunction

    def template_call(self) -> dict[str, Any]:
        """The call as chat templates take it: arguments as a mapping (templates write ``arguments | tojson``)."""
        arguments = json.loads(self.function.arguments) if self.function.arguments.strip() else {}
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": arguments},
        }

    def stored(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": self.function.arguments},
        }
