"""The body of POST /v1/responses (OpenAI's Responses API): ``input`` as a string or a list of items (messages,
function calls and their outputs, reasoning), ``instructions``, flat function ``tools``, ``previous_response_id``,
``store``; and its translation to the chat request it is answered as (ResponseRequest.chat_request)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from app.protocol.completions import ChatCompletionRequest
from app.protocol.fields import MAX_MESSAGES, Count, RequestModel
from app.protocol.sampling import SamplingFields
from app.protocol.tools import MAX_TOOLS, CalledFunction, FunctionName

CallId = Annotated[str, Field(min_length=1, max_length=64)]


class InputText(RequestModel):
    type: Literal["input_text", "output_text"]
    text: str


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: CallId
    name: FunctionName
    arguments: str = Field(description="the arguments as JSON text (an object)")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        return CalledFunction._json_object(value)  # the chat message's check


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: CallId
    output: str | list[InputText]


class ReasoningText(RequestModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(RequestModel):
    """A reply's reasoning sent back (``input=previous.output + [...]``): kept with the assistant turn after it."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None


_ITEMS = {
    "message": "MessageItem",
    "function_call": "FunctionCallItem",
    "function_call_output": "FunctionCallOutputItem",
    "reasoning": "ReasoningItem",
}


def _item_tag(value: Any) -> str | None:
    """An item's member: its ``type`` (a message may leave it out: OpenAI's easy input message)."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return _ITEMS.get(kind) if isinstance(kind, str) else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("MessageItem")]
    | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")]
    | Annotated[ReasoningItem, Tag("ReasoningItem")],
    Discriminator(
        _item_tag,
        custom_error_type="invalid_item",
        custom_error_message=f"type: must be one of {', '.join(_ITEMS)}",
    ),
]


class FunctionTool(RequestModel):
    """A function as the Responses API declares it: flat, not nested under ``function``."""

    type: Literal["function"]
    name: FunctionName
    description: str | None = Field(default=None, max_length=4096)
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(
        default=None, description="always enforced: a call's arguments follow the schema's grammar"
    )

    def chat_tool(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: FunctionName


class Reasoning(RequestModel):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = Field(default=None, description="ignored: reasoning is returned whole")


class PlainText(RequestModel):
    type: Literal["text"]


class JsonObject(RequestModel):
    type: Literal["json_object"]


class JsonSchemaText(RequestModel):
    """Structured output as the Responses API states it: the schema's fields flat under ``format``."""

    type: Literal["json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="a JSON Schema the reply follows")
    strict: bool | None = None


_TEXT_FORMATS = {"text": "PlainText", "json_object": "JsonObject", "json_schema": "JsonSchemaText"}


def _text_format_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _TEXT_FORMATS.get(kind) if isinstance(kind, str) else None


TextFormat = Annotated[
    Annotated[PlainText, Tag("PlainText")]
    | Annotated[JsonObject, Tag("JsonObject")]
    | Annotated[JsonSchemaText, Tag("JsonSchemaText")],
    Discriminator(
        _text_format_tag,
        custom_error_type="invalid_format",
        custom_error_message=f"type: must be one of {', '.join(_TEXT_FORMATS)}",
    ),
]


class TextConfig(RequestModel):
    format: TextFormat | None = None

    def response_format(self) -> dict[str, Any] | None:
        """The chat request's ``response_format``."""
        fmt = self.format
        if not isinstance(fmt, JsonSchemaText):
            return fmt.model_dump() if fmt is not None else None
        spec = fmt.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)
        return {"type": "json_schema", "json_schema": spec}

    def echo(self) -> dict[str, Any]:
        """As a response object repeats it."""
        fmt = self.format or PlainText(type="text")
        return {"format": fmt.model_dump(exclude_none=True, by_alias=True)}


class ResponseRequest(SamplingFields):
    input: str | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: str | None = Field(
        default=None,
        description="the system prompt; fixed for a conversation (previous_response_id): a "
        "later response may repeat it or leave it out",
    )
    previous_response_id: str | None = Field(
        default=None,
        description="continue the conversation of this response (it must be its latest): the "
        "history's tokens are reused exactly, so they hit the prefix cache",
    )
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Count | None = None
    reasoning: Reasoning | None = None
    store: bool = Field(default=True, description="false: answered statelessly, never retrievable")
    metadata: (
        Annotated[
            dict[
                Annotated[str, Field(max_length=64)],
                Annotated[str, Field(max_length=512)],
            ],
            Field(max_length=16),
        ]
        | None
    ) = None
    text: TextConfig | None = None

    @model_validator(mode="after")
    def _supported(self) -> ResponseRequest:
        if self.n != 1:
            raise ValueError("n: a response has one reply")
        if self.response_format is not None:
            raise ValueError("response_format: not a Responses API field (text.format is)")
        return self

    def messages(self) -> list[dict[str, Any]]:
        """The input as chat messages: a function_call_output is a tool message, consecutive function calls one
        assistant message's tool_calls, a reasoning item the next assistant message's reasoning_content."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        reasoning: str | None = None
        for item in self.input:
            if isinstance(item, ReasoningItem):
                reasoning = "".join(part.text for part in item.content or [])
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(
                    {"role": "tool", "content": _text(item.output), "tool_call_id": item.call_id}
                )
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function"}
                call["function"] = {"name": item.name, "arguments": item.arguments}
                last = messages[-1] if messages else None
                if last is None or last["role"] != "assistant":
                    last = {"role": "assistant", "content": None}
                    messages.append(last)
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": item.role, "content": _text(item.content)})
            if reasoning is not None and messages and messages[-1]["role"] == "assistant":
                messages[-1]["reasoning_content"], reasoning = reasoning, None
        return messages

    def chat_request(self, messages: list[dict[str, Any]]) -> ResponseAsChat:
        """The chat request this response is answered as: the same sampling fields (so the same limits and 400s),
        the tools in the chat shape. A problem in the input's conversation is a ValueError naming ``input``."""
        sampling = self.model_dump(include=set(SamplingFields.model_fields), exclude_unset=True)
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = {"type": "function", "function": {"name": choice.name}}
        body = {
            **sampling,
            "stream": False,
            "messages": messages,
            "tools": [t.chat_tool() for t in self.tools] if self.tools else None,
            "tool_choice": choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "reasoning_effort": self.reasoning.effort if self.reasoning else None,
            "max_completion_tokens": self.max_output_tokens,
            "response_format": self.text.response_format() if self.text else None,
        }
        try:
            return ResponseAsChat.model_validate(body)
        except ValidationError as exc:
            problem = exc.errors(include_url=False)[0]
            message = problem["msg"].removeprefix("Value error, ")
            if not problem["loc"]:  # a check of the whole request, in the chat fields' names
                raise ValueError(message.replace("response_format", "text.format")) from None
            where = ".".join(str(part) for part in problem["loc"])
            raise ValueError(f"input: {where}: {message}") from None


class ResponseAsChat(ChatCompletionRequest):
    """A response's chat request: errors about its size name the Responses API's fields."""

    def max_tokens_field(self) -> str:
        return "max_output_tokens"

    def prompt_field(self) -> str:
        return "input"
