"""Tool calls are never malformed: 200 grammar-forced calls of functions with random parameter schemas, sampled
from the default model (temperature 1, so the model wanders wherever the grammar lets it), each parsed by the reply
parser as the server streams it: every call names its function and its arguments parse as JSON valid against the
function's schema. Also the grammar for each syntax (hermes, llama3_json, mistral) accepts well-formed replies and
refuses malformed ones, whatever tokens the vocabulary has for the markers."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from app.chat_format.formats import detect_chat_format
from app.chat_format.plan import ReplyPlan, ToolUse, tool_grammar_spec
from app.protocol.tools import NamedToolChoice, Tool
from engine import LLM
from engine.sampling_params import SamplingParams
from tests.engine.test_fault_isolation import assert_idle

NUM_CALLS = 200


def _named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A function's parameters: an object of 0-4 properties of JSON Schema's common kinds (strings with bounds,
    integers with ranges, numbers, booleans, enums, arrays of a kind, nested objects), some required."""
    names = rng.sample(
        ["city", "unit", "count", "query", "tags", "flag", "limit", "when", "to"],
        k=rng.randint(0, 4),
    )
    properties = {name: _random_property(rng, depth) for name in names}
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    required = [name for name in names if rng.random() < 0.6]
    if required:
        schema["required"] = required
    return schema


def _random_property(rng: random.Random, depth: int) -> dict[str, Any]:
    """Every kind bounded in length, so a call always fits max_tokens: JSON Schema bounds no number's digits, and
    a number sampled at temperature 1 ran to max_tokens (seen under AVX2 numerics); numbers are multiples of a
    quarter here, integers in a range."""
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array", "object"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 999)}
    if kind == "number":
        return {"type": "number", "minimum": -1000, "maximum": 1000, "multipleOf": 0.25}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {
            "enum": rng.sample(
                ["red", "green", "blue", "c", "f", "now", "later"], k=rng.randint(1, 3)
            )
        }
    if kind == "array" or depth >= 1:
        return {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "maxItems": 3,
        }
    return random_schema(rng, depth + 1)


def test_two_hundred_forced_calls_over_random_schemas_parse_and_validate(default_model_dir: Path):
    rng = random.Random(51)
    llm = LLM(kv_cache_memory_gib=1.0)
    fmt = detect_chat_format(llm.tokenizer.chat_template, llm.tokenizer)
    plan = ReplyPlan(fmt, parse_tools=True)
    prompt = llm.chat_prompt_ids([{"role": "user", "content": "Call the function."}])
    cases = []
    for i in range(NUM_CALLS):
        name = f"fn_{i}"
        schema = random_schema(rng)
        tools = [
            Tool.model_validate(
                {"type": "function", "function": {"name": name, "parameters": schema}}
            )
        ]
        decoy = Tool.model_validate(
            {"type": "function", "function": {"name": "other", "parameters": random_schema(rng)}}
        )
        use = ToolUse.of(
            [decoy, *tools],
            "required" if i % 2 else _named(name),
            False,
        )
        cases.append((name, schema, decoy, use))
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=400,
            structured_output=tool_grammar_spec(fmt, use, False),
        )
        for i, (_, _, _, use) in enumerate(cases)
    ]
    outputs = llm.generate([prompt] * NUM_CALLS, params)
    for i, (out, (name, schema, decoy, _)) in enumerate(zip(outputs, cases)):
        assert out.finish_reason == "stop", out.text
        parser = plan.parser(f"fuzz:{i}")
        parser.feed(out.text, final=True)
        assert len(parser.calls) == 1 and not parser.content.strip(), out.text
        call = parser.calls[0]
        expected = {call.name} <= {name, decoy.function.name} if i % 2 else call.name == name
        assert expected, out.text
        arguments = json.loads(call.arguments)
        jsonschema.validate(arguments, schema if call.name == name else decoy.function.parameters)
    assert_idle(llm.engine)


# the grammar per syntax, without the model --------------------------------------------------------------

CALL = '{"name": "get_weather", "ARGS": {"city": "Paris"}}'
TOOLS = [
    Tool.model_validate(
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ),
    Tool.model_validate({"type": "function", "function": {"name": "now"}}),
]
TEMPLATES = {  # enough of each family's template for detect_chat_format to pick its syntax
    "hermes": "{{ tools }} <tool_call> </think>",
    "mistral": "{{ tools }} [TOOL_CALLS]",
    "llama3_json": "{{ tools }} <|start_header_id|> tool_call",
}


def _calls(syntax: str, count: int) -> str:
    one = CALL.replace("ARGS", "parameters" if syntax == "llama3_json" else "arguments")
    if syntax == "hermes":
        return "\n".join([f"<tool_call>\n{one}\n</tool_call>"] * count)
    if syntax == "mistral":
        return "[TOOL_CALLS][" + ", ".join([one] * count) + "]"
    return one


@pytest.fixture(scope="module", params=["text markers", "token markers"])
def tokenizer(request, default_model_dir: Path):
    """The default tokenizer as it is (markers are text), and with the markers as added tokens (as in Qwen's and
    Mistral's vocabularies)."""
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    if request.param == "token markers":
        tok.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>", "[TOOL_CALLS]"])
    return tok, llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))


def _accepts(tokenizer, lark: str, text: str) -> bool:
    tok, ll = tokenizer
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(lark))
    ids = tok.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


@pytest.mark.parametrize("syntax", list(TEMPLATES))
def test_each_syntax_grammar_takes_well_formed_calls_and_refuses_the_rest(tokenizer, syntax: str):
    fmt = detect_chat_format(TEMPLATES[syntax], tokenizer[0])
    assert fmt.tools.name == syntax

    def lark(choice: str | NamedToolChoice, parallel: bool = True) -> str:
        return tool_grammar_spec(fmt, ToolUse.of(TOOLS, choice, parallel), False).schema

    bad_arguments = _calls(syntax, 1).replace('"city"', '"town"')
    assert _accepts(tokenizer, lark("required"), _calls(syntax, 1))
    assert not _accepts(tokenizer, lark("required"), "Sure, here it is.")
    assert not _accepts(tokenizer, lark("required"), bad_arguments)
    assert not _accepts(
        tokenizer, lark("required"), _calls(syntax, 1).replace("get_weather", "get_time")
    )
    named = lark(_named("now"))
    assert not _accepts(tokenizer, named, _calls(syntax, 1))
    assert _accepts(tokenizer, lark("auto"), "No call needed: it is sunny.")
    if syntax != "llama3_json":  # (one call per reply in Llama 3's templates)
        assert _accepts(tokenizer, lark("required"), _calls(syntax, 2))
        assert not _accepts(tokenizer, lark("required", parallel=False), _calls(syntax, 2))
        assert _accepts(tokenizer, lark("auto"), "Let me look that up. " + _calls(syntax, 1))
        assert not _accepts(tokenizer, lark("auto"), "Let me look. " + bad_arguments)
    else:
        assert _accepts(tokenizer, lark("auto"), _calls(syntax, 1))
        assert not _accepts(tokenizer, lark("auto"), bad_arguments)
