"""The bodies of /tokenize and /detokenize (vLLM's)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from app.protocol.fields import MAX_MESSAGES, RequestModel, TokenId
from app.protocol.messages import ChatMessage


class TokenizeRequest(RequestModel):
    """vLLM's /tokenize: a text prompt, or chat messages rendered by the model's template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = (
        None
    )
    add_special_tokens: bool = Field(
        default=True, description="with prompt: the tokenizer's BOS and the like"
    )
    return_token_strs: bool = Field(default=False, description="also each token's text")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give either prompt or messages")
        return self


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1_000_000)]
