"""The one chat-template path (STYLE.md): a conversation rendered by the model's own template, and the prompt's
token ids. Every caller (the offline LLM, the server's prompts and sessions, the CLI chat) goes through here, so
they all give the model the same tokens for the same messages."""

from __future__ import annotations

from typing import Any


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> str:
    """The conversation as text, as the model's chat template writes it ("" for no messages); with
    ``add_generation_prompt`` it ends where the assistant's reply starts."""
    if not messages:
        return ""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )


def chat_prompt_ids(
    tokenizer: Any, messages: list[dict[str, str]], **template_kwargs: Any
) -> list[int]:
    """The token ids of a chat prompt: the rendered text, encoded without special tokens of the tokenizer's own
    (the template already wrote the ones the model expects)."""
    text = render_chat(tokenizer, messages, True, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False) if text else []
