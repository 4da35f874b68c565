"""Prompt rendering and tokenization, off the event loop: the one chat-template path of the server.

The renderer encodes on one worker thread of its own, so a long prompt never blocks the event loop. Its tokenizer
is the engine's (EngineClient.tokenizer), which the detokenizer uses on the event loop meanwhile: its settings were
fixed at load so that no call mutates the Rust tokenizer (engine/worker/tokenizer_files.py ``fix_settings``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from engine.chat_template import chat_prompt_ids

T = TypeVar("T")


class NoTokenizer(ValueError):
    """Text in or out was asked of a model loaded without a tokenizer."""


class PromptRenderer:
    def __init__(self, tokenizer: Any | None) -> None:
        """``tokenizer``: the engine's, loaded by ``load_tokenizer`` (nothing mutates it: shared safely)."""
        self._tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedchat-tokenizer")

    @property
    def has_tokenizer(self) -> bool:
        """False for dummy weights: prompts must be token ids, and outputs have no text."""
        return self._tokenizer is not None

    async def chat(
        self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template, ending with the assistant's
        generation prompt; ``template_kwargs`` are extra template variables (e.g. Qwen3's enable_thinking)."""
        self._require()
        return await self._run(self._render_chat, messages, template_kwargs or {})

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._run(self._require().encode, text, add_special_tokens=add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        return await self._run(self._require().decode, token_ids, skip_special_tokens=False)

    async def encode_each(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Each prompt's token ids (a text tokenized, token ids as given), in one trip to the tokenizer thread: a
        batch costs the event loop one wake-up, not one per prompt."""
        if all(isinstance(prompt, list) for prompt in prompts):
            return [list(prompt) for prompt in prompts]
        tokenizer = self._require()
        return await self._run(
            lambda: [p if isinstance(p, list) else tokenizer.encode(p) for p in prompts]
        )

    async def decode_each(self, prompts: list[list[int]]) -> list[str]:
        tokenizer = self._require()
        return await self._run(
            lambda: [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]
        )

    async def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return await self._run(self.tokens_as_text, token_ids)

    def tokens_as_text(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (byte-level BPE pieces decoded one by one), as OpenAI's logprobs show it;
        ``token_id:N`` without a tokenizer."""
        if self._tokenizer is None:
            return [f"token_id:{token_id}" for token_id in token_ids]
        return [self._tokenizer.decode([token_id]) for token_id in token_ids]

    async def in_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(tokenizer, *args, **kwargs)`` on the tokenizer thread (for multi-step work such as
        app/sessions/conversation.py)."""
        return await self._run(fn, self._require(), *args, **kwargs)

    def _require(self) -> Any:
        if self._tokenizer is None:
            raise NoTokenizer(
                "prompt: this model has no tokenizer (dummy weights); send token ids to "
                "/v1/completions"
            )
        return self._tokenizer

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _render_chat(
        self, messages: list[dict[str, str]], template_kwargs: dict[str, Any]
    ) -> list[int]:
        return chat_prompt_ids(self._tokenizer, messages, **template_kwargs)

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))
