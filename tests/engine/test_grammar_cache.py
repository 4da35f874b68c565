"""GrammarCache (engine/output/grammar_cache.py): compile outcomes by a hash of the spec, least recently used out
first once their bytes pass the bound; a refusal is kept as its message."""

from __future__ import annotations

import pytest

from engine.output.grammar_cache import GrammarCache, Outcome, spec_key
from engine.sampling_params import StructuredOutput


def compiled(schema: str, grammar_bytes: int) -> Outcome:
    spec = StructuredOutput("json_schema", schema=schema, grammar="g" * grammar_bytes)
    return Outcome(compiled=spec)


def test_the_key_is_the_kind_and_the_schema_text():
    a = StructuredOutput("json_schema", schema='{"type": "object"}')
    assert spec_key(a) == spec_key(StructuredOutput("json_schema", schema='{"type": "object"}'))
    assert spec_key(a) != spec_key(StructuredOutput("json_schema", schema='{"type":"object"}'))
    assert spec_key(a) != spec_key(StructuredOutput("json_object"))


def test_the_least_recently_used_goes_first_once_the_bytes_pass_the_bound():
    cache = GrammarCache(
        max_bytes=8 * 1300
    )  # (an eighth: 1300 bytes; each entry ~1,000 + its overhead)
    for name in "abcdefg":
        cache.put(name, compiled(name, 1000))
    assert len(cache) == 7
    assert cache.get("a") is not None  # (now the most recently used)
    for name in "hijk":
        cache.put(name, compiled(name, 1000))
    assert cache.nbytes <= cache.max_bytes and len(cache) == 8, "eight entries of ~1,257 bytes fit"
    assert cache.get("a") is not None, "used lately: kept"
    assert all(cache.get(k) is None for k in "bcd"), "the least recently used: gone"


def test_an_outcome_larger_than_an_eighth_of_the_bound_is_not_kept():
    cache = GrammarCache(max_bytes=8000)
    cache.put("small", compiled("s", 100))
    cache.put("large", compiled("l", 2000))
    assert cache.get("large") is None and cache.get("small") is not None


def test_a_refusal_is_kept_and_raised_again():
    cache = GrammarCache()
    cache.put("bad", Outcome(refusal="response_format: invalid JSON schema: no"))
    with pytest.raises(ValueError, match="^response_format: invalid JSON schema: no$"):
        cache.get("bad").result()
    assert cache.hits == 1 and cache.misses == 0
