"""GrammarCache: what compiling a response_format gave, kept across requests by a hash of the spec.

A client sends the same schema with every request; compiling it again costs a worker's CPU each time (seconds for
a large enum) and a compile past its limit costs a worker. The front keeps each spec's outcome, the compiled spec
or the refusal's message (a schema the grammar library refuses is refused again, the same way), in an LRU bounded
by bytes: a compiled grammar of a large enum is megabytes, and the schemas are the clients'. Outcomes that depend on
the machine (a compile past its time limit) are not kept.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from engine.sampling_params import StructuredOutput

MAX_BYTES = 64 * 2**20
_ENTRY_OVERHEAD = (
    256  # bytes an entry costs besides its text: the key, the objects, the dict's slot
)


@dataclass(frozen=True, slots=True)
class Outcome:
    """A compile's outcome: the spec with its grammar, or the message of the ValueError that refused it."""

    compiled: StructuredOutput | None = None
    refusal: str | None = None

    def result(self) -> StructuredOutput:
        """The compiled spec, or ValueError with the refusal's message."""
        if self.compiled is None:
            raise ValueError(self.refusal)
        return self.compiled

    @property
    def nbytes(self) -> int:
        if self.compiled is None:
            return _ENTRY_OVERHEAD + len(self.refusal or "")
        return _ENTRY_OVERHEAD + len(self.compiled.grammar or "") + len(self.compiled.schema or "")


def spec_key(spec: StructuredOutput) -> str:
    """sha256 of what the compiled grammar depends on: the kind and the schema's text."""
    text = f"{spec.kind}\0{spec.schema or ''}"
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class GrammarCache:
    """Outcomes by ``spec_key``, least recently used first out once their bytes pass ``max_bytes``; an outcome
    larger than an eighth of the bound is not kept (one schema must not empty the cache)."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, Outcome] = OrderedDict()

    def get(self, key: str) -> Outcome | None:
        outcome = self._entries.get(key)
        if outcome is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return outcome

    def put(self, key: str, outcome: Outcome) -> None:
        if outcome.nbytes > self.max_bytes // 8:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._entries[key] = outcome
        self.nbytes += outcome.nbytes
        while self.nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes

    def __len__(self) -> int:
        return len(self._entries)
