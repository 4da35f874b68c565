"""Request models at the HTTP edge (OpenAI shapes plus vLLM's and our extensions), and their translation to
the engine's SamplingParams.

Types are strict (``"0.5"`` is not a number), unknown fields are ignored as OpenAI-compatible servers do,
and fields that would change the answer but are not supported get a 400 naming them rather than silence.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.sampling_params import MAX_LOGPROBS, SamplingParams

Role = Literal["system", "developer", "user", "assistant"]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: required for role {self.role!r}")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def as_template_message(self) -> dict[str, str]:
        """The chat template's view: developer messages are system messages (OpenAI's newer name)."""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}


class StreamOptions(_Model):
    include_usage: bool = False


class SamplingFields(_Model):
    """Sampling and stopping, shared by chat, completions and session messages."""

    model: str | None = None
    temperature: float | None = Field(default=None, description="0 = greedy; default 1")
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = Field(default=None, description="default: up to the model's context length")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, description="requests share prefix blocks only with the same salt")
    user: str | None = None
    logit_bias: dict[str, float] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompt_field(self) -> str:
        """The field that carries the prompt (named in errors about its length)."""
        return "messages"

    def requested_logprobs(self) -> int | None:
        return None

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """ValueError naming the field for values the engine refuses or a prompt that leaves no room."""
        if self.n != 1:
            raise ValueError("n: only n=1 is supported (parallel sampling comes later)")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported")
        room = max_model_len - num_prompt_tokens
        max_tokens = self.requested_max_tokens()
        if room < 1 or (max_tokens is not None and max_tokens > room):
            wanted = f", {max_tokens} in the completion" if max_tokens is not None else ""
            raise ValueError(f"{'max_tokens' if room >= 1 else self.prompt_field()}: this model's maximum context length "
                             f"is {max_model_len} tokens; the request has {num_prompt_tokens} in the prompt{wanted}")
        values = {name: getattr(self, name) for name in _OPTIONAL_SAMPLING if getattr(self, name) is not None}
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else room, stop=_as_list(self.stop),
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logprobs=self.requested_logprobs(), **values,
        )


_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                      "repetition_penalty")


class ResponseFormat(_Model):
    type: Literal["text"] = Field(description="only plain text is supported")


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    session_id: str | None = Field(default=None, description="continue a server-kept session (or X-Session-ID)")

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.tools:
            raise ValueError("tools: not supported (no tool calling)")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[str], Field(min_length=1)] | Annotated[list[int], Field(min_length=1)] \
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of: only 1 is supported")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo: not supported together with logprobs (prompt logprobs are not computed)")
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

    def prompt_field(self) -> str:
        return "prompt"


def _as_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


# sessions -----------------------------------------------------------------------------------------------


class CreateSessionRequest(_Model):
    system: str | None = Field(default=None, description="system prompt (or use a preset)")
    preset: str | None = Field(default=None, description="name of a preset whose system prompt to use")
    title: str | None = Field(default=None, max_length=200)
    cache_salt: str | None = Field(default=None, description="this session's prefix blocks are shared only with "
                                   "requests carrying the same salt")

    @model_validator(mode="after")
    def _one_system(self) -> CreateSessionRequest:
        if self.system is not None and self.preset is not None:
            raise ValueError("preset: give a system prompt or a preset, not both")
        return self


class UpdateSessionRequest(_Model):
    title: Annotated[str, Field(min_length=1, max_length=200)]


class SessionMessageRequest(SamplingFields):
    content: str | None = Field(default=None, description="the user's message")
    regenerate: bool = Field(default=False, description="drop the last reply and answer the last message again")

    def prompt_field(self) -> str:
        return "content"

    @model_validator(mode="after")
    def _content_or_regenerate(self) -> SessionMessageRequest:
        if self.regenerate == (self.content is not None):
            raise ValueError("content: give the message's content, or regenerate=true without content")
        return self


class CreatePresetRequest(_Model):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
    system: Annotated[str, Field(min_length=1)]
