"""Incremental detokenization and stop strings for one sequence's output.

Text is produced token by token from a small sliding window of ids rather than by decoding the whole output
each step, so a step costs O(window) and not O(output length). Two things must never reach the client: a
character split across tokens (decoded as U+FFFD until its last byte arrives) and the beginning of a stop
string that may still complete (held back by ``take_delta`` until it is either completed or ruled out).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens that seed the window. Tokenizers decode a token differently at the start of a text (SentencePiece
# drops a word-initial space there), so the first output token needs a little real context before it.
_SEED_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Output text of one sequence, grown by ``update`` and handed out in pieces by ``take_delta``.

    Window invariant over ``_ids`` (prompt seed + output ids): ids ``[_prefix_offset, _read_offset)`` are
    already in ``text`` and are decoded only as context; ids from ``_read_offset`` on are not in ``text`` yet.
    """

    __slots__ = (
        "_tokenizer",
        "_skip_special_tokens",
        "_stop",
        "_include_stop",
        "_max_stop_len",
        "_ids",
        "_prefix_offset",
        "_read_offset",
        "_sent",
        "text",
        "stop_str",
    )

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stop = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = list(prompt_token_ids[-_SEED_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._sent = 0  # characters of `text` already returned by take_delta
        self.text = ""
        self.stop_str: str | None = None  # the stop string that ended the output, once one has

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append output tokens; return the stop string now present in the output (text cut there), else None."""
        if self.stop_str is not None:
            raise RuntimeError(f"update() after stop string {self.stop_str!r} ended the output")
        old_len = len(self.text)
        self._ids.extend(new_token_ids)
        self.text += self._decode_new_text()
        return self._find_stop(old_len)

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet, minus (while unfinished) a tail that could still become a stop string."""
        end = len(self.text)
        if not finished and self.stop_str is None:
            end -= self._ambiguous_tail_len()
        if end <= self._sent:
            return ""
        delta = self.text[self._sent : end]
        self._sent = end
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new_text(self) -> str:
        # Decoding the window with and without the unread ids and taking the difference gives exactly what
        # the unread ids add in context (leading spaces, merged bytes), which decoding them alone would not.
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            # Nothing visible yet (a skipped special token) or a character still missing bytes: keep the
            # unread ids and retry with the next token.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _find_stop(self, old_len: int) -> str | None:
        # A stop string lying wholly inside the old text was already searched for, so a new match must end
        # after old_len, i.e. start at or after old_len - max_stop_len + 1.
        if not self._stop or len(self.text) == old_len:
            return None
        start = max(0, old_len - self._max_stop_len + 1)
        # (index, length, stop): earliest wins, then shortest
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            index = self.text.find(stop, start)
            if index != -1 and (best is None or (index, len(stop)) < best[:2]):
                best = (index, len(stop), stop)
        if best is None:
            return None
        index, length, stop = best
        self.text = self.text[: index + length] if self._include_stop else self.text[:index]
        self.stop_str = stop
        return stop

    def _ambiguous_tail_len(self) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
