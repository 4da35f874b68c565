"""A model's chat format, read once from its chat template and tokenizer: how it writes tool calls (the syntax,
its trigger, whether the template renders tools itself), and its reasoning markers.

Tool-call syntaxes of the families we serve:

- ``hermes`` (Hermes 2/3, Qwen2.5, Qwen3 and most ChatML models): ``<tool_call>\\n{"name": N, "arguments": A}
  \\n</tool_call>``, one block per call, blocks separated by a newline;
- ``llama3_json`` (Llama 3.1-3.3): the reply is one ``{"name": N, "parameters": A}`` object;
- ``mistral`` (Mistral v3 tokenizers): ``[TOOL_CALLS][{"name": N, "arguments": A}, ...]``.

A marker that is one token of the vocabulary (``<tool_call>`` in Qwen's, ``[TOOL_CALLS]`` in Mistral's) is
constrained and recognised as that token: llguidance sees added tokens as special, never as their text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL_FORMATS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True, slots=True)
class ToolSyntax:
    name: str
    opener: str  # written before the calls ("" for llama3_json)
    closer: str  # after each call (hermes) or after the list (mistral)
    separator: str  # between two calls
    arguments_key: str  # "arguments" or "parameters"
    parallel: bool = True  # the template renders several calls in one message


SYNTAXES = {
    "hermes": ToolSyntax("hermes", "<tool_call>\n", "\n</tool_call>", "\n", "arguments"),
    "llama3_json": ToolSyntax("llama3_json", "", "", "", "parameters", parallel=False),
    "mistral": ToolSyntax("mistral", "[TOOL_CALLS]", "]", ", ", "arguments"),
}


@dataclass(frozen=True, slots=True)
class ChatFormat:
    tools: ToolSyntax
    # the template takes ``tools=`` (otherwise the server describes the tools in a system message of its own)
    renders_tools: bool
    # token ids of markers that are single tokens: "<tool_call>" -> 151657
    marker_ids: dict[str, int]
    # reasoning markers (``<think>``, ``</think>``), or None for a model that does not reason
    reasoning: tuple[str, str] | None
    # special token ids the detokenizer would hide (a marker among them needs skip_special_tokens=False)
    special_ids: frozenset[int] = frozenset()

    @classmethod
    def plain(cls) -> ChatFormat:
        """No tokenizer (dummy weights): no markers; text stays content."""
        return cls(SYNTAXES["hermes"], False, {}, None)

    def marker_is_special(self, marker: str) -> bool:
        return self.marker_ids.get(marker) in self.special_ids


def detect_chat_format(
    template: str | None, tokenizer: Any, override: str | None = None
) -> ChatFormat:
    """The format of a model with chat template ``template``; ``override`` (``--tool-call-format``) picks the
    tool-call syntax by name."""
    text = template or ""
    if override is not None and override != "auto":
        if override not in SYNTAXES:
            raise ValueError(
                f"--tool-call-format: must be auto or one of {', '.join(TOOL_CALL_FORMATS)}"
            )
        syntax = SYNTAXES[override]
    elif "[TOOL_CALLS]" in text:
        syntax = SYNTAXES["mistral"]
    elif "<|start_header_id|>" in text and "<tool_call>" not in text:
        syntax = SYNTAXES["llama3_json"]
    else:  # (Hermes's <tool_call> blocks, and the fallback for a template of no known syntax)
        syntax = SYNTAXES["hermes"]
    reasoning = ("<think>", "</think>") if "</think>" in text else None
    markers = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<think>", "</think>"]
    return ChatFormat(
        tools=syntax,
        renders_tools=bool(re.search(r"\btools\b", text)),
        marker_ids={m: i for m in markers if (i := _single_token(tokenizer, m)) is not None},
        reasoning=reasoning,
        special_ids=frozenset(getattr(tokenizer, "all_special_ids", []) or []),
    )


def _single_token(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` when the vocabulary holds it as one added token."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode it has no such token
        return None
    if len(ids) == 1 and text in tokenizer.get_added_vocab():
        return ids[0]
    return None
