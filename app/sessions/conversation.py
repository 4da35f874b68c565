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

Templates of reasoning models (Qwen3, DeepSeek-R1) drop a reply's reasoning once a later user message follows
it, so the stored ids (which hold the reasoning as generated) are not a prefix of the next render. For them the
next prompt extends the previous turn's *prompt* instead (``after_last_prompt``): its ids are kept exactly and only
the reply as the template now writes it, plus the new turn, is tokenized and prefilled:

    ids(turn k+1) = prompt_ids(turn k) + encode(render(history + new) - render(history up to turn k's prompt))

``kwargs`` are the template's variables for the whole session (its tools, enable_thinking); a turn whose variables
differ from the stored turns' re-renders the conversation.

All functions here run on the PromptRenderer's thread (they take its tokenizer).
"""

from __future__ import annotations

import logging
from typing import Any

from engine.chat_template import render_chat

logger = logging.getLogger(__name__)


class NotAnExtension(ValueError):
    """The chat template does not render the history as a prefix of the longer conversation."""


def render(
    tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool, **kwargs: Any
) -> str:
    return render_chat(tokenizer, messages, generation_prompt, **kwargs)


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def system_prefix_ids(tokenizer: Any, system: str) -> list[int]:
    """The tokens every conversation with this system prompt starts with (what a preset pins)."""
    return encode(tokenizer, render(tokenizer, [{"role": "system", "content": system}], False))


def first_turn_ids(
    tokenizer: Any, system: str | None, new: list[dict[str, Any]], **kwargs: Any
) -> list[int]:
    head = [{"role": "system", "content": system}] if system is not None else []
    if kwargs:  # (tools render into the system part: no preset prefix to keep)
        return encode(tokenizer, render(tokenizer, head + new, True, **kwargs))
    return encode(tokenizer, render(tokenizer, head, False)) + encode(
        tokenizer, _delta(tokenizer, head, head + new)
    )


def next_turn_ids(
    tokenizer: Any,
    stored_ids: list[int],
    history: list[dict[str, Any]],
    new: list[dict[str, Any]],
    eos_token_ids: tuple[int, ...],
    **kwargs: Any,
) -> list[int]:
    """``history`` (system first, ending with an assistant reply) is what ``stored_ids`` hold."""
    closure = _assistant_closure(tokenizer, history, kwargs)
    if stored_ids and stored_ids[-1] in eos_token_ids:
        eos_text = tokenizer.decode([stored_ids[-1]], skip_special_tokens=False)
        closure = closure.removeprefix(eos_text)
    return stored_ids + encode(
        tokenizer, closure + _delta(tokenizer, history, history + new, kwargs)
    )


def after_last_prompt(
    tokenizer: Any,
    last_prompt_ids: list[int],
    history: list[dict[str, Any]],
    new: list[dict[str, Any]],
    **kwargs: Any,
) -> list[int]:
    """The next prompt as an extension of the last turn's prompt ``last_prompt_ids`` (what ``history`` without its
    last reply rendered with a generation prompt): for templates that rewrite a reply once the conversation goes
    on (reasoning dropped). NotAnExtension if even that prompt is not a prefix of the new render."""
    before = render(tokenizer, history[:-1], True, **kwargs)
    after = render(tokenizer, history + new, True, **kwargs)
    if not after.startswith(before):
        raise NotAnExtension("the chat template renders the earlier turns differently")
    return last_prompt_ids + encode(tokenizer, after[len(before) :])


def full_render_ids(tokenizer: Any, conversation: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """The stateless way (the fallback for templates that are not prefix-stable)."""
    return encode(tokenizer, render(tokenizer, conversation, True, **kwargs))


def _delta(
    tokenizer: Any,
    history: list[dict[str, Any]],
    longer: list[dict[str, Any]],
    kwargs: dict[str, Any] | None = None,
) -> str:
    kwargs = kwargs or {}
    before = render(tokenizer, history, False, **kwargs)
    after = render(tokenizer, longer, True, **kwargs)
    if not after.startswith(before):
        raise NotAnExtension(
            "the chat template renders the history differently once a turn is added"
        )
    return after[len(before) :]


def _assistant_closure(
    tokenizer: Any, history: list[dict[str, Any]], kwargs: dict[str, Any]
) -> str:
    reply = history[-1]
    if reply["role"] != "assistant":
        raise NotAnExtension("the history does not end with an assistant reply")
    if reply.get("tool_calls") or reply.get("reasoning_content"):
        # (the stored ids hold the calls and reasoning as generated; the template writes them its own way)
        raise NotAnExtension("the reply's calls or reasoning are written by the template")
    opened = render(tokenizer, history[:-1], True, **kwargs) + reply["content"]
    closed = render(tokenizer, history, False, **kwargs)
    if not closed.startswith(opened):
        raise NotAnExtension("the chat template rewrites assistant replies")
    return closed[len(opened) :]
