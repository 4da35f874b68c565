"""The token-exact conversation: the next turn's prompt is the session's stored token ids (the previous prompt
and the reply exactly as generated) followed by the tokens of what the chat template adds for the new turn.

Re-rendering and re-tokenizing the whole history each turn (what a stateless client does) can drift from the
tokens the model actually produced, and one changed token early on changes every later block hash, so the
prefix cache misses. Extending the stored ids cannot drift:

    ids(turn k+1) = ids(turn k) + encode(closure + delta)

``closure`` is what the template writes after an assistant reply (e.g. ``<|im_end|>\\n``), less the EOS token the
model already generated; ``delta`` is the template's text for the new messages and the generation prompt:
render(history + new, generation prompt) minus render(history). A system prompt (a preset) is encoded on its own
first, so its blocks are the same for every session that starts with it.

All functions here run on the PromptRenderer's thread (they take its tokenizer).
"""

from __future__ import annotations

import logging
from typing import Any

from engine.chat_template import render_chat

logger = logging.getLogger(__name__)


class NotAnExtension(ValueError):
    """The chat template does not render the history as a prefix of the longer conversation."""


def render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return render_chat(tokenizer, messages, generation_prompt)


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def system_prefix_ids(tokenizer: Any, system: str) -> list[int]:
    """The tokens every conversation with this system prompt starts with (what a preset pins)."""
    return encode(tokenizer, render(tokenizer, [{"role": "system", "content": system}], False))


def first_turn_ids(tokenizer: Any, system: str | None, new: list[dict[str, str]]) -> list[int]:
    head = [{"role": "system", "content": system}] if system is not None else []
    return encode(tokenizer, render(tokenizer, head, False)) + encode(
        tokenizer, _delta(tokenizer, head, head + new)
    )


def next_turn_ids(
    tokenizer: Any,
    stored_ids: list[int],
    history: list[dict[str, str]],
    new: list[dict[str, str]],
    eos_token_ids: tuple[int, ...],
) -> list[int]:
    """``history`` (system first, ending with an assistant reply) is what ``stored_ids`` hold."""
    closure = _assistant_closure(tokenizer, history)
    if stored_ids and stored_ids[-1] in eos_token_ids:
        eos_text = tokenizer.decode([stored_ids[-1]], skip_special_tokens=False)
        closure = closure.removeprefix(eos_text)
    return stored_ids + encode(tokenizer, closure + _delta(tokenizer, history, history + new))


def full_render_ids(tokenizer: Any, conversation: list[dict[str, str]]) -> list[int]:
    """The stateless way (the fallback for templates that are not prefix-stable)."""
    return encode(tokenizer, render(tokenizer, conversation, True))


def _delta(tokenizer: Any, history: list[dict[str, str]], longer: list[dict[str, str]]) -> str:
    before, after = render(tokenizer, history, False), render(tokenizer, longer, True)
    if not after.startswith(before):
        raise NotAnExtension(
            "the chat template renders the history differently once a turn is added"
        )
    return after[len(before) :]


def _assistant_closure(tokenizer: Any, history: list[dict[str, str]]) -> str:
    reply = history[-1]
    if reply["role"] != "assistant":
        raise NotAnExtension("the history does not end with an assistant reply")
    opened = render(tokenizer, history[:-1], True) + reply["content"]
    closed = render(tokenizer, history, False)
    if not closed.startswith(opened):
        raise NotAnExtension("the chat template rewrites assistant replies")
    return closed[len(opened) :]
