"""The field types request bodies share: numbers in the engine's ranges, strings, logit bias, and RequestModel,
the strict base of every body (``"0.5"`` is not a number; unknown fields are ignored)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_SAMPLES, MAX_STOP_STRING_CHARS

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
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64), BeforeValidator(_integral)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), BeforeValidator(_integral)]
NumSamples = Annotated[int, Field(ge=1, le=MAX_SAMPLES), BeforeValidator(_integral)]
# of one request (a body of tens of thousands costs the event loop ~5 us each to check)
MAX_MESSAGES = 4096
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Salt = Annotated[str, Field(max_length=256)]
Text = Annotated[str, Field(min_length=1)]
# OpenAI's shape: token ids as decimal strings -> a bias added to the logit
LogitBias = Annotated[
    dict[
        Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")],
        Annotated[float, Field(ge=-100, le=100)],
    ],
    Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={"additionalProperties": False}),
]


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
