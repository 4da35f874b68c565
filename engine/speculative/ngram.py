"""Drafts from a sequence's own tokens: find the most recent earlier occurrence of its last n tokens (the longest n
in ``[MIN_NGRAM, MAX_NGRAM]`` that occurred before) and propose the tokens that followed it.

A sequence's tokens are its prompt (for a session turn: the system prompt and every earlier turn, re-sent as an
exact token prefix) and its reply so far, so a reply that quotes the question, re-emits code it was shown, or
regenerates an earlier answer finds its continuation there (prompt lookup decoding; vLLM's ``ngram`` method).

The index is incremental: ``last_seen[n][gram]`` is the position right after the latest occurrence of ``gram``
whose follower is known; each new token adds one gram per n, so a step costs O(MAX_NGRAM) dict operations
whatever the length. Building it is linear in what it covers, ~4 us a token: it covers a sequence's last
INDEX_WINDOW tokens (a long session's recent turns; 33 ms of building), and enters at most UPDATE_BUDGET positions
a step, so a long prompt's index is built over a few steps (each paying ~8 ms) rather than in one that stalls every
other stream; until it is built, proposals come from what it covers.
"""

from __future__ import annotations

MIN_NGRAM = 2
MAX_NGRAM = 5
INDEX_WINDOW = 8192  # the most recent tokens an index covers from its start
UPDATE_BUDGET = 2048  # positions entered per update at most


class NgramIndex:
    def __init__(self, start: int = 0) -> None:
        """``start``: the first position the index covers."""
        self.last_seen: list[dict[tuple[int, ...], int]] = [{} for _ in range(MAX_NGRAM + 1)]
        self.num_indexed = (
            start  # tokens [start, num_indexed) have every gram ending before them entered
        )
        self.start = start

    @classmethod
    def over(cls, num_tokens: int) -> NgramIndex:
        """An index for a token list now ``num_tokens`` long: its last INDEX_WINDOW tokens and what follows."""
        return cls(max(0, num_tokens - INDEX_WINDOW))

    def update(self, tokens: list[int], num_known: int, budget: int = UPDATE_BUDGET) -> None:
        """Enter the grams of ``tokens[:num_known]`` not entered yet (at most ``budget`` positions): each gram
        ``tokens[p - n : p]`` maps to ``p`` (the position of its follower), for ``p`` up to ``num_known - 1`` (a
        follower must be known)."""
        last_seen, first = self.last_seen, self.start
        end = min(num_known, self.num_indexed + budget)
        for p in range(max(self.num_indexed, first + MIN_NGRAM), end):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, p - first) + 1):
                last_seen[n][tuple(tokens[p - n : p])] = p
        self.num_indexed = max(self.num_indexed, end)

    def propose(
        self,
        tokens: list[int],
        num_known: int,
        max_tokens: int,
        context: tuple[NgramIndex, list[int]] | None = None,
    ) -> list[int]:
        """Up to ``max_tokens`` tokens to follow ``tokens[:num_known]``: those after the latest earlier
        occurrence of its longest suffix (of MIN_NGRAM to MAX_NGRAM tokens); [] if none. ``context``: another
        token list (indexed whole) searched too, after ``tokens`` for each length."""
        if max_tokens <= 0 or num_known < MIN_NGRAM:
            return []
        self.update(tokens, num_known)
        if context is not None and context[0].num_indexed < len(context[1]):
            context[0].update(context[1], len(context[1]))
        for n in range(min(MAX_NGRAM, num_known), MIN_NGRAM - 1, -1):
            gram = tuple(tokens[num_known - n : num_known])
            start = self.last_seen[n].get(gram)
            if start is not None:
                return tokens[start : min(start + max_tokens, num_known)]
            if context is not None and (start := context[0].last_seen[n].get(gram)) is not None:
                return context[1][start : start + max_tokens]
        return []
