"""The chat format read from real templates (Qwen3, Qwen2.5, Hermes 3, Llama 3.2, Mistral Nemo, DeepSeek-R1; from
llama.cpp's test data, on Qwen's real tokenizer: tests/tiny_qwen3.py): each gets its family's tool-call syntax and
reasoning markers, renders a conversation with tools, a call and its result, and — where the model writes calls as
the template does — the call grammar takes the template's own rendering of a call: what the model is made to write
is what it was trained on, and what the next turn's template renders."""

from __future__ import annotations

from pathlib import Path

import llguidance
import llguidance.hf
import pytest

from app.chat_format.formats import detect_chat_format
from app.chat_format.plan import ToolUse, calls_as_text, tool_grammar_spec
from app.chat_format.reply_parser import call_id
from app.protocol.tools import Tool
from engine.config import EngineConfig
from engine.weights.gguf_model_dir import gguf_model_dir
from engine.worker.tokenizer_files import load_tokenizer
from tests.tiny_qwen3 import cached_tiny_qwen3_gguf

# template -> (syntax, renders tools, reasoning markers, the template writes calls as the model does)
TEMPLATES = {
    "Qwen-Qwen3-0.6B": ("hermes", True, True, True),
    "Qwen-Qwen2.5-7B-Instruct": ("hermes", True, False, True),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("hermes", True, False, True),
    "meta-llama-Llama-3.2-3B-Instruct": ("llama3_json", True, False, True),
    # (Nemo's template adds each call's id, which the model does not write)
    "mistralai-Mistral-Nemo-Instruct-2407": ("mistral", True, False, False),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("hermes", False, True, False),
}
TOOL = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
)
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>", "<｜end▁of▁sentence｜>")


@pytest.fixture(scope="module", params=list(TEMPLATES))
def template(request) -> tuple[str, object]:
    path = cached_tiny_qwen3_gguf(request.param)
    return request.param, load_tokenizer(gguf_model_dir(Path(path), Path(EngineConfig().cache_dir)))


def test_the_format_renders_tools_a_call_and_its_result_and_the_grammar_takes_the_templates_call(
    template,
):
    name, tokenizer = template
    syntax, renders_tools, reasoning, same_calls = TEMPLATES[name]
    fmt = detect_chat_format(tokenizer.chat_template, tokenizer)
    assert (fmt.tools.name, fmt.renders_tools, fmt.reasoning is not None) == (
        syntax,
        renders_tools,
        reasoning,
    )
    call = {
        "id": call_id(fmt, "test", 0),
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    asked = [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    called = [*asked, {"role": "assistant", "content": "", "tool_calls": [call]}]
    answered = [
        *called,
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temp_c": 21}'},
        {"role": "assistant", "content": "It is 21 degrees."},
        {"role": "user", "content": "Thanks."},
    ]
    tools = [TOOL.template_tool()] if renders_tools else None

    def render(messages, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    whole = render(answered, True)
    assert "Paris" in whole and "21" in whole
    # another client's ids (OpenAI's call_...) render too: mapped where the template wants its own kind
    foreign = [
        {**m, "tool_calls": [{**call, "id": "call_0123456789abcdef"}]}
        if m.get("tool_calls")
        else {**m, "tool_call_id": "call_0123456789abcdef"}
        if m.get("tool_call_id")
        else m
        for m in answered
    ]
    assert "21" in render(calls_as_text(fmt, foreign), True)
    if renders_tools:
        assert "get_weather" in render(asked, True)
    if not same_calls:
        return
    before, after = render(asked, True), render(called, False)
    assert after.startswith(before)
    written = after[len(before) :]
    lark = tool_grammar_spec(fmt, ToolUse.of([TOOL], "required", False), False).schema
    ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(lark))
    ids = tokenizer.encode(written, add_special_tokens=False)
    taken = 0
    for token in ids:
        if matcher.is_accepting() or not matcher.consume_token(token):
            break
        taken += 1
    assert matcher.is_accepting(), (written, matcher.get_error())
    rest = tokenizer.decode(ids[taken:]).strip()
    assert rest.startswith(END_OF_TURN) or not rest, (written, rest)
