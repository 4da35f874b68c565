"""The bodies of /v1/chat/completions and /v1/completions."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from app.protocol.fields import MAX_MESSAGES, Count, NumLogprobs, NumSamples, Text, TokenId
from app.protocol.messages import ChatMessage
from app.protocol.sampling import SamplingFields
from app.protocol.tools import MAX_TOOLS, Tool, ToolChoice


# what the chat template is called with by the server itself: a request may not set these through
# chat_template_kwargs
_RESERVED_TEMPLATE_KWARGS = {
    "messages",
    "conversation",
    "tokenize",
    "add_generation_prompt",
    "chat_template",
    "return_dict",
    "return_assistant_tokens_mask",
    "continue_final_message",
    "tools",
    "documents",
    "tokenizer",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
}
TemplateValue = bool | int | float | Annotated[str, Field(max_length=256)] | None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    chat_template_kwargs: (
        Annotated[
            dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")], TemplateValue],
            Field(max_length=16),
        ]
        | None
    ) = Field(
        default=None,
        description='extra variables for the model\'s chat template, e.g. {"enable_thinking": '
        "false} for Qwen3 (vLLM's field); scalars only",
    )
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        default=None, description="functions the model may call (their parameters as JSON Schemas)"
    )
    tool_choice: ToolChoice | None = Field(
        default=None,
        description="none, auto (the default with tools), required, or a named function; a call's "
        "arguments always follow its schema (grammar-constrained)",
    )
    parallel_tool_calls: bool | None = Field(
        default=None, description="several calls in one reply (default true)"
    )
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        default=None,
        description="for reasoning models: none or minimal turns thinking off where the template "
        "can (Qwen3's enable_thinking); the value also reaches the template",
    )
    session_id: str | None = Field(
        default=None,
        json_schema_extra={"pattern": "^[A-Za-z0-9_-]{22}$"},
        description="continue a server-kept session (or X-Session-ID); an unknown "
        "well-formed id starts one",
    )

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        fmt = self.response_format
        if self.tools and self.tool_choice != "none" and fmt is not None and fmt.type != "text":
            raise ValueError(
                "response_format: cannot be combined with tools (a tool call's arguments are "
                'already constrained); use tool_choice "none" or leave one out'
            )
        if self.session_id is not None and not self.session_id:
            raise ValueError(
                "session_id: empty; leave it out for a stateless request, or give a session's id"
            )
        reserved = sorted(set(self.chat_template_kwargs or {}) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(
                f"chat_template_kwargs: {', '.join(reserved)} is set by the server, not a request"
            )
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        return self

    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    logprobs: NumLogprobs | None = None
    echo: bool = False
    suffix: str | None = Field(
        default=None, json_schema_extra={"maxLength": 0}, description="not supported"
    )
    best_of: NumSamples | None = Field(
        default=None,
        description="sample this many (>= n) and return the n of "
        "highest cumulative logprob; with stream=true only equal to n",
    )

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of: must be >= n ({self.n})")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ValueError(
                "best_of: must equal n when stream=true (the best choices are known only at the end)"
            )
        if self.echo and self.logprobs is not None:
            raise ValueError(
                "echo: not supported together with logprobs (prompt logprobs are not computed)"
            )
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: a text to tokenize or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return list(prompt)

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_best_of(self) -> int | None:
        return self.best_of

    def prompt_field(self) -> str:
        return "prompt"
