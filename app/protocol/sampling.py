"""The sampling and stopping fields every generating request shares (SamplingFields, with response_format's
structured output), and their translation to the engine's SamplingParams."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import Discriminator, Field, PrivateAttr, Tag

from app.protocol.fields import (
    Count,
    LogitBias,
    NumSamples,
    Penalty,
    RequestModel,
    Salt,
    Seed,
    StopString,
    TokenId,
    TopK,
)
from engine.sampling_params import (
    MAX_PRIORITY,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    StructuredOutput,
)


class StreamOptions(RequestModel):
    include_usage: bool = False


class TextFormat(RequestModel):
    type: Literal["text"]


class JsonObjectFormat(RequestModel):
    type: Literal["json_object"]


class JsonSchemaSpec(RequestModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] = Field(
        alias="schema", description="a JSON Schema the reply must be valid against"
    )
    strict: bool | None = Field(
        default=None,
        description="always enforced: the reply is generated under the schema's grammar",
    )
    # a large schema's JSON text, set aside before validation (app/request_body.py): ``schema_`` is then {} and the
    # grammar worker parses the text, off the event loop
    _raw_schema: str | None = PrivateAttr(default=None)

    def schema_text(self) -> str:
        # (msgspec: a 4 MB schema re-encodes in milliseconds, on the event loop; json.dumps takes ~8x as long)
        return (
            self._raw_schema
            if self._raw_schema is not None
            else msgspec.json.encode(self.schema_).decode()
        )


class JsonSchemaFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


_FORMATS = {
    "text": "TextFormat",
    "json_object": "JsonObjectFormat",
    "json_schema": "JsonSchemaFormat",
}


def _format_tag(value: Any) -> str | None:
    """The member a response_format is (class names as tags, so an error's path names fields only)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _FORMATS.get(kind) if isinstance(kind, str) else None


ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("TextFormat")]
    | Annotated[JsonObjectFormat, Tag("JsonObjectFormat")]
    | Annotated[JsonSchemaFormat, Tag("JsonSchemaFormat")],
    Discriminator(
        _format_tag,
        custom_error_type="invalid_format",
        custom_error_message=f"type: must be one of {', '.join(_FORMATS)}",
    ),
]


class SamplingFields(RequestModel):
    """Sampling and stopping, shared by chat, completions and session messages."""

    model: str | None = None
    temperature: float | None = Field(
        default=None,
        ge=0,
        le=2,
        description="0 = greedy; default 1 (or the model's "
        "generation config); at most 2, as OpenAI",
    )
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: TopK | None = Field(
        default=None, description="-1 or 0: off; at most the vocabulary size"
    )
    min_p: float | None = Field(default=None, ge=0, le=1)
    max_tokens: Count | None = Field(
        default=None,
        description="default: --default-max-tokens or the room left "
        "in the context, whichever is smaller",
    )
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
    n: NumSamples = Field(
        default=1, description="choices to generate: the prompt is computed once, its KV shared"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: Salt | None = Field(
        default=None, description="requests share prefix blocks only with the same salt"
    )
    priority: int = Field(
        default=0,
        ge=-MAX_PRIORITY,
        le=MAX_PRIORITY,
        description="among the same tenant's "
        "requests, lower runs first (vLLM's field); tenants share the engine fairly whatever it is",
    )
    user: str | None = None
    return_token_ids: bool = Field(
        default=False,
        description="each choice also carries its token_ids (in a "
        "streamed chunk: the ids new in it); vLLM's field",
    )
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = Field(
        default=None, description="json_object or json_schema: the reply is constrained to it"
    )
    # beam search, an extension (vLLM's names): the n best of beam_width beams, returned when the search ends
    use_beam_search: bool = Field(
        default=False, description="deterministic beam search (sampling fields ignored)"
    )
    beam_width: NumSamples | None = Field(
        default=None, description="beams kept per step (default 4; >= n)"
    )
    length_penalty: float | None = Field(
        default=None,
        ge=-10,
        le=10,
        description="hypothesis score = sum of logprobs / length ** length_penalty (default 1)",
    )
    early_stopping: bool | Literal["never"] | None = Field(
        default=None, description="transformers' meaning; default false"
    )
    # an extension: where the server runs speculative decoding (--speculative), false keeps this request to one
    # token a step (its tokens are the same either way)
    speculative: bool = Field(
        default=True,
        description="false: no speculative decoding for this request (where the server runs it); "
        "the output is the same either way",
    )

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompt_field(self) -> str:
        """The field that carries the prompt (named in errors about its length)."""
        return "messages"

    def max_tokens_field(self) -> str:
        """The field that sets max_tokens (named in errors about the request's size)."""
        return "max_tokens"

    def requested_logprobs(self) -> int | None:
        return None

    def requested_best_of(self) -> int | None:
        return None

    def sampling_params(
        self,
        num_prompt_tokens: int,
        max_model_len: int,
        default_max_tokens: int,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """ValueError naming the field for values the engine refuses or a prompt that leaves no room. ``defaults``
        (the model's generation config) fill the sampling fields the request leaves unset."""
        room = max_model_len - num_prompt_tokens
        max_tokens = self.requested_max_tokens()
        if room < 1 or (max_tokens is not None and max_tokens > room):
            wanted = f", {max_tokens} in the completion" if max_tokens is not None else ""
            raise ValueError(
                f"{self.max_tokens_field() if room >= 1 else self.prompt_field()}: this model's maximum context length "
                f"is {max_model_len} tokens; the request has {num_prompt_tokens} in the prompt{wanted}"
            )
        if max_tokens is None:  # a bare request must not hold a slot for the whole context
            max_tokens = min(max(default_max_tokens, self.min_tokens), room)
        values = {
            name: getattr(self, name)
            for name in _OPTIONAL_SAMPLING
            if getattr(self, name) is not None
        }
        if defaults and not self.use_beam_search:  # (beam search takes no sampling fields)
            values = {**defaults, **values}
        return SamplingParams(
            n=self.n,
            best_of=self.requested_best_of(),
            use_beam_search=self.use_beam_search,
            max_tokens=max_tokens,
            stop=_as_list(self.stop),
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=self.requested_logprobs(),
            logit_bias={int(token): bias for token, bias in self.logit_bias.items()}
            if self.logit_bias
            else None,
            structured_output=self.structured_output(),
            speculative=self.speculative,
            **values,
        )

    def structured_output(self) -> StructuredOutput | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutput("json_object")
        return StructuredOutput("json_schema", schema=fmt.json_schema.schema_text())


_OPTIONAL_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "beam_width",
    "length_penalty",
    "early_stopping",
)


def _as_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)
