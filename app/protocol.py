"""Request models at the HTTP edge (OpenAI shapes plus vLLM's and our extensions), and their translation to
the engine's SamplingParams.

Types are strict (``"0.5"`` is not a number), unknown fields are ignored as OpenAI-compatible servers do,
and fields that would change the answer but are not supported get a 400 naming them rather than silence.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, PrivateAttr, Tag,
                      model_validator)

from engine.sampling_params import (MAX_LOGIT_BIAS, MAX_PRIORITY, MAX_LOGPROBS, MAX_SAMPLES, MAX_STOP_STRING_CHARS,
                                    MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams, StructuredOutput)

_INT32 = 2**31


def _integral(value: Any) -> Any:
    """JSON has one number type: 5.0 is the integer 5 (as JSON Schema says); 5.5 stays a float and is refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# The engine's ranges (engine/sampling_params.py), stated here too so a bad value is refused before anything is
# looked up or locked, and /openapi.json shows them; what depends on the model (top_k and token ids below the
# vocabulary size) the engine checks when the request is submitted. (Bounds go before the validator, or they do
# not reach the JSON schema.)
TokenId = Annotated[int, Field(ge=0, lt=_INT32), BeforeValidator(_integral)]
Count = Annotated[int, Field(ge=1, lt=_INT32), BeforeValidator(_integral)]
TopK = Annotated[int, Field(ge=-1, lt=_INT32), BeforeValidator(_integral)]
Seed = Annotated[int, Field(ge=-2**63, lt=2**64), BeforeValidator(_integral)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), BeforeValidator(_integral)]
NumSamples = Annotated[int, Field(ge=1, le=MAX_SAMPLES), BeforeValidator(_integral)]
MAX_MESSAGES = 4096  # of one request (a body of tens of thousands costs the event loop ~5 us each to check)
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Salt = Annotated[str, Field(max_length=256)]
Text = Annotated[str, Field(min_length=1)]
# OpenAI's shape: token ids as decimal strings -> a bias added to the logit
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")],
                           Annotated[float, Field(ge=-100, le=100)]],
                      Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={"additionalProperties": False})]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextPart(_Model):
    type: Literal["text"]
    text: str


class _Message(_Model):
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
    Annotated[InputMessage, Tag("InputMessage")] | Annotated[AssistantMessage, Tag("AssistantMessage")],
    Discriminator(_message_tag, custom_error_type="invalid_role",
                  custom_error_message=f"role: must be one of {', '.join(_ROLES)}")]


class StreamOptions(_Model):
    include_usage: bool = False


class TextFormat(_Model):
    type: Literal["text"]


class JsonObjectFormat(_Model):
    type: Literal["json_object"]


class JsonSchemaSpec(_Model):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="a JSON Schema the reply must be valid against")
    strict: bool | None = Field(default=None, description="always enforced: the reply is generated under the "
                                "schema's grammar")
    # a large schema's JSON text, set aside before validation (app/request_body.py): ``schema_`` is then {} and the
    # grammar worker parses the text, off the event loop
    _raw_schema: str | None = PrivateAttr(default=None)

    def schema_text(self) -> str:
        # (msgspec: a 4 MB schema re-encodes in milliseconds, on the event loop; json.dumps takes ~8x as long)
        return self._raw_schema if self._raw_schema is not None else msgspec.json.encode(self.schema_).decode()


class JsonSchemaFormat(_Model):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


_FORMATS = {"text": "TextFormat", "json_object": "JsonObjectFormat", "json_schema": "JsonSchemaFormat"}


def _format_tag(value: Any) -> str | None:
    """The member a response_format is (class names as tags, so an error's path names fields only)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _FORMATS.get(kind) if isinstance(kind, str) else None


ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("TextFormat")] | Annotated[JsonObjectFormat, Tag("JsonObjectFormat")]
    | Annotated[JsonSchemaFormat, Tag("JsonSchemaFormat")],
    Discriminator(_format_tag, custom_error_type="invalid_format",
                  custom_error_message=f"type: must be one of {', '.join(_FORMATS)}")]


class SamplingFields(_Model):
    """Sampling and stopping, shared by chat, completions and session messages."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2, description="0 = greedy; default 1 (or the model's "
                                      "generation config); at most 2, as OpenAI")
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: TopK | None = Field(default=None, description="-1 or 0: off; at most the vocabulary size")
    min_p: float | None = Field(default=None, ge=0, le=1)
    max_tokens: Count | None = Field(default=None, description="default: --default-max-tokens or the room left "
                                     "in the context, whichever is smaller")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # > 0 for the engine; a penalty near 0 divides logits into inf/NaN, so the edge keeps it to a useful range
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=100)
    ignore_eos: bool = False
    min_tokens: TokenId = 0  # a count, in the token ids' range
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: NumSamples = Field(default=1, description="choices to generate: the prompt is computed once, its KV shared")
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: Salt | None = Field(default=None, description="requests share prefix blocks only with the same salt")
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY, description="among the same tenant's "
                          "requests, lower runs first (vLLM's field); tenants share the engine fairly whatever it is")
    user: str | None = None
    return_token_ids: bool = Field(default=False, description="each choice also carries its token_ids (in a "
                                   "streamed chunk: the ids new in it); vLLM's field")
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = Field(default=None, description="json_object or json_schema: the "
                                                   "reply is constrained to it")
    # beam search, an extension (vLLM's names): the n best of beam_width beams, returned when the search ends
    use_beam_search: bool = Field(default=False, description="deterministic beam search (sampling fields ignored)")
    beam_width: NumSamples | None = Field(default=None, description="beams kept per step (default 4; >= n)")
    length_penalty: float | None = Field(default=None, ge=-10, le=10, description="hypothesis score = sum of "
                                         "logprobs / length ** length_penalty (default 1)")
    early_stopping: bool | Literal["never"] | None = Field(default=None, description="transformers' meaning; "
                                                           "default false")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompt_field(self) -> str:
        """The field that carries the prompt (named in errors about its length)."""
        return "messages"

    def requested_logprobs(self) -> int | None:
        return None

    def requested_best_of(self) -> int | None:
        return None

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int, default_max_tokens: int,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """ValueError naming the field for values the engine refuses or a prompt that leaves no room. ``defaults``
        (the model's generation config) fill the sampling fields the request leaves unset."""
        room = max_model_len - num_prompt_tokens
        max_tokens = self.requested_max_tokens()
        if room < 1 or (max_tokens is not None and max_tokens > room):
            wanted = f", {max_tokens} in the completion" if max_tokens is not None else ""
            raise ValueError(f"{'max_tokens' if room >= 1 else self.prompt_field()}: this model's maximum context length "
                             f"is {max_model_len} tokens; the request has {num_prompt_tokens} in the prompt{wanted}")
        if max_tokens is None:  # a bare request must not hold a slot for the whole context
            max_tokens = min(max(default_max_tokens, self.min_tokens), room)
        values = {name: getattr(self, name) for name in _OPTIONAL_SAMPLING if getattr(self, name) is not None}
        if defaults and not self.use_beam_search:  # (beam search takes no sampling fields)
            values = {**defaults, **values}
        return SamplingParams(
            n=self.n, best_of=self.requested_best_of(), use_beam_search=self.use_beam_search, max_tokens=max_tokens, stop=_as_list(self.stop),
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logprobs=self.requested_logprobs(),
            logit_bias={int(token): bias for token, bias in self.logit_bias.items()} if self.logit_bias else None,
            structured_output=self.structured_output(), **values,
        )

    def structured_output(self) -> StructuredOutput | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutput("json_object")
        return StructuredOutput("json_schema", schema=fmt.json_schema.schema_text())


_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                      "repetition_penalty", "beam_width", "length_penalty", "early_stopping")


# what the chat template is called with by the server itself: a request may not set these through
# chat_template_kwargs
_RESERVED_TEMPLATE_KWARGS = {"messages", "conversation", "tokenize", "add_generation_prompt", "chat_template",
                             "return_dict", "return_assistant_tokens_mask", "continue_final_message", "tools",
                             "documents", "tokenizer", "padding", "truncation", "max_length", "return_tensors"}
TemplateValue = bool | int | float | Annotated[str, Field(max_length=256)] | None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    chat_template_kwargs: Annotated[dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")],
                                         TemplateValue], Field(max_length=16)] | None = Field(
        default=None, description="extra variables for the model's chat template, e.g. {\"enable_thinking\": "
                                  "false} for Qwen3 (vLLM's field); scalars only")
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, json_schema_extra={"maxItems": 0},
                                               description="not supported: a request with tools gets 400")
    session_id: str | None = Field(default=None, json_schema_extra={"pattern": "^[A-Za-z0-9_-]{22}$"},
                                   description="continue a server-kept session (or X-Session-ID); an unknown "
                                   "well-formed id starts one")

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.tools:
            raise ValueError("tools: not supported (no tool calling)")
        if self.session_id is not None and not self.session_id:
            raise ValueError("session_id: empty; leave it out for a stateless request, or give a session's id")
        reserved = sorted(set(self.chat_template_kwargs or {}) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} is set by the server, not a request")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: Text | Annotated[list[Text], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)] \
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    logprobs: NumLogprobs | None = None
    echo: bool = False
    suffix: str | None = Field(default=None, json_schema_extra={"maxLength": 0}, description="not supported")
    best_of: NumSamples | None = Field(default=None, description="sample this many (>= n) and return the n of "
                                       "highest cumulative logprob; with stream=true only equal to n")

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of: must be >= n ({self.n})")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ValueError("best_of: must equal n when stream=true (the best choices are known only at the end)")
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

    def requested_best_of(self) -> int | None:
        return self.best_of

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
    cache_salt: Salt | None = Field(default=None, description="this session's prefix blocks are shared only with "
                                    "requests carrying the same salt")

    @model_validator(mode="after")
    def _one_system(self) -> CreateSessionRequest:
        if self.system is not None and self.preset is not None:
            raise ValueError("preset: give a system prompt or a preset, not both")
        return self


class UpdateSessionRequest(_Model):
    title: Annotated[str, Field(min_length=1, max_length=200)]


class SessionMessageRequest(SamplingFields):
    # the schema says what the validator below checks: content, or regenerate=true without content
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["content"], "properties": {"content": {"type": "string"}, "regenerate": {"const": False}}},
        {"required": ["regenerate"], "properties": {"regenerate": {"const": True}, "content": {"type": "null"}}}]})

    content: str | None = Field(default=None, description="the user's message")
    n: NumSamples = Field(default=1, json_schema_extra={"maximum": 1}, description="a session turn stores one reply: "
                          "only 1")
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
    shared: bool = Field(default=False, description="every tenant sees it (admin key only); otherwise it is the "
                         "creating key's own")


class TokenizeRequest(_Model):
    """vLLM's /tokenize: a text prompt, or chat messages rendered by the model's template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool = Field(default=True, description="with prompt: the tokenizer's BOS and the like")
    return_token_strs: bool = Field(default=False, description="also each token's text")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give either prompt or messages")
        return self


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1_000_000)]
