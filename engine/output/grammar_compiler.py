"""Structured output's grammars: a request's ``response_format`` (any JSON object, JSON valid against a schema, or
a Lark grammar) compiled and checked with llguidance, for one model's tokenizer.

Why llguidance: it computes a token mask from the grammar state in tens of microseconds on the CPU without a
precompiled per-vocabulary table (no start-up cost per schema), supports JSON Schema with strict checking of
unsupported keywords, ships abi3 wheels with no torch pin, and is what vLLM and SGLang also offer.

No torch here (masks are numpy words): the grammar workers (engine/grammar_worker.py) import this, llguidance and
the tokenizer's file (grammar_tokenizer.py) only.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from engine.free_heap import release_free_heap
from engine.output.grammar_tokenizer import grammar_tokenizer
from engine.output.remote_matchers import RemoteMatchers
from engine.output.schema_check import unsatisfiable
from engine.sampling_params import StructuredOutput

logger = logging.getLogger(__name__)

_OBJECT_SCHEMA = '{"type": "object"}'
CHECK_STEPS = 4  # grammar steps tried before a request is admitted
# a grammar whose next-token mask takes longer would stall every stream of the step
MASK_BUDGET_S = 0.25
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarCompiler:
    """Compiles StructuredOutput specs into matchers for one tokenizer (compiled grammars are cached)."""

    def __init__(
        self, source: Any | Future | None, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> None:
        """``source``: the model's tokenizer.json (a grammar_tokenizer.TokenizerFile) or the loaded Hugging Face
        tokenizer, a Future of either (loading in the background: the first grammar waits), or None (no
        tokenizer: a grammar is refused). With a Future, ``warm_in_background`` builds llguidance's form of the
        tokenizer on a thread, so the first grammar on the engine's step loop does not pay for it (seconds on a
        busy machine)."""
        self._source = source
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()  # (a compiler may be shared between threads)
        self._tokenizer: Any | None = None
        self._warming = False
        # the matchers' server, when one holds them (``use_remote``): no tokenizer built here
        self._remote: RemoteMatchers | None = None

    def use_remote(self, path: str) -> None:
        """Hold matchers in the matcher server listening at ``path`` (engine/output/remote_matchers.py) from now on:
        connected at the first grammar (its zygote builds once the front is healthy); where none answers then, this
        process builds the tokenizer and keeps that grammar's matcher. The first server told of stays (with several
        fronts, each tells of its own zygote's)."""
        if self._remote is None:
            self._remote = RemoteMatchers(path, self.vocab_size)

    def warm_in_background(self) -> None:
        """Build llguidance's tokenizer and a first grammar on a thread, once (for a Future source; else the first
        grammar builds it). The build holds the GIL throughout (2-3 s for a 262k-token vocabulary), so the engine
        core calls this once idle after its start, not while it loads: there it delayed the core's readiness."""
        if self._warming or self._remote is not None or not isinstance(self._source, Future):
            return
        self._warming = True
        threading.Thread(target=self._warm, name="pagedchat-grammar-warm", daemon=True).start()

    def _warm(self) -> None:
        try:
            self.matcher(StructuredOutput("json_object"))
        except ValueError:  # (no tokenizer, or no llguidance: the first grammar says so)
            pass
        except Exception:  # (the first grammar raises it again, where it can be answered)
            logger.warning("structured output: warming the grammar library failed", exc_info=True)

    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                if isinstance(self._source, Future):
                    self._source = self._source.result()
                if self._source is None:
                    raise ValueError("response_format: this model has no tokenizer (dummy weights)")
                self._tokenizer = grammar_tokenizer(
                    self._source, self.vocab_size, self._eos_token_ids
                )
                # (the file's text or the tokenizer: llguidance's copy is all it needs; its parse's garbage goes
                # back to the system)
                self._source = None
                release_free_heap()
            return self._tokenizer

    def validate(self, spec: StructuredOutput) -> str:
        """The compiled grammar; ValueError naming ``response_format`` when the schema cannot be compiled, or its
        grammar allows no first token (some schemas compile but leave the parser nowhere to go). A spec that
        carries its compiled grammar was checked where it was compiled."""
        if spec.grammar is not None:
            return spec.grammar
        grammar = self._grammar(spec)
        _check_usable(self.ll_tokenizer(), grammar)
        return grammar

    def compiled(self, spec: StructuredOutput) -> StructuredOutput:
        """``spec`` checked, with its compiled grammar (for the engine core: no compiling on its step loop)."""
        return dataclasses.replace(spec, grammar=self.validate(spec))

    def matcher(self, spec: StructuredOutput) -> Any:
        """A matcher for ``spec`` (in the matcher server where one is used and the spec carries its grammar)."""
        if self._remote is not None and spec.grammar is not None:
            try:
                self._remote.connect()
            except OSError as exc:
                # (its zygote ended and is not back yet: this matcher is kept here, the next tries again)
                logger.warning(
                    "structured output: no matcher server at %s (%s); a matcher kept here",
                    self._remote.path,
                    exc,
                )
            else:
                return self._remote.matcher(spec.grammar)
        import llguidance

        return llguidance.LLMatcher(self.ll_tokenizer(), self._grammar(spec))

    def _grammar(self, spec: StructuredOutput) -> str:
        if spec.grammar is not None:
            return spec.grammar
        if spec.kind == "lark":
            return _compile_lark(self.ll_tokenizer(), spec.schema)
        return _compile(
            self.ll_tokenizer(), spec.schema if spec.kind == "json_schema" else _OBJECT_SCHEMA
        )


# (bounded: a compiled grammar of a large enum is megabytes, and schemas are the clients')
@functools.lru_cache(maxsize=32)
def _compile(tokenizer: Any, schema: str) -> str:
    import llguidance

    try:
        parsed = json.loads(schema)
    except ValueError as exc:
        raise ValueError(f"response_format: invalid JSON schema: {exc}") from None
    if unsatisfiable(parsed):
        raise ValueError(
            "response_format: no finite JSON value satisfies this schema (a required property or item "
            "needs the schema itself); make the recursion optional"
        )
    try:
        if isinstance(parsed, dict):
            # one fixed layout: with free whitespace a greedy model can emit blank lines until max_tokens
            parsed.setdefault("x-guidance", _LAYOUT)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(parsed))
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - llguidance reports schema errors as ValueError or its own
        reason = (
            str(exc) or f"{type(exc).__name__} (no reason given: too large for the memory allowed?)"
        )
        raise ValueError(f"response_format: invalid JSON schema: {reason}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise ValueError(f"response_format: invalid JSON schema: {error}")
    return grammar


@functools.lru_cache(maxsize=32)
def _compile_lark(tokenizer: Any, lark: str) -> str:
    """An llguidance Lark grammar (the front's tool-call grammars embed each function's schema with ``%json``)."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise ValueError(f"response_format: invalid grammar: {error.splitlines()[0]}")
    return grammar


@functools.lru_cache(maxsize=32)
def _check_usable(tokenizer: Any, grammar: str) -> None:
    """The grammar allows a first token, and its first ``CHECK_STEPS`` steps (each taking the lowest allowed token
    other than EOS) work, each mask within ``MASK_BUDGET_S`` of CPU: a grammar whose lexer explodes (a regex pattern
    like ``^(a{1000}){1000}$``) is refused here, not after the answer has started on the engine's step loop."""
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar)
    words = np.full(-(-tokenizer.vocab_size // 32), -1, dtype=np.int32)
    for step in range(CHECK_STEPS):
        # (this thread's CPU time: a busy machine's wall clock would blame the schema for the load)
        start = time.thread_time()
        matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        elapsed = time.thread_time() - start
        if matcher.is_error() or not words.any():
            if step == 0 or matcher.is_error():
                reason = (matcher.get_error() or "no token can start the output").splitlines()[0]
                raise ValueError(f"response_format: the schema cannot be followed: {reason}")
            return
        if elapsed > MASK_BUDGET_S:
            raise ValueError(
                f"response_format: following this schema takes {elapsed * 1e3:.0f} ms of CPU per token (at "
                f"most {MASK_BUDGET_S * 1e3:.0f} ms); simplify it"
            )
        # (bit j of word w is token 32w + j)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: tokenizer.vocab_size]
        allowed = bits.nonzero()[0].tolist()
        token = next((t for t in allowed if t not in tokenizer.eos_tokens), None)
        if token is None:
            return
        if not matcher.consume_token(token):
            reason = (matcher.get_error() or "refused").splitlines()[0]
            raise ValueError(f"response_format: the schema cannot be followed: {reason}")
