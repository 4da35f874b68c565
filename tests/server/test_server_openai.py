"""The official ``openai`` client against a running server: greedy answers equal the offline engine's (chat and
completions, streamed or not), token counts agree, and the model card, OpenAPI document and ``serve --help``
promise what the docs say."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_harness import (
    SMALL_KV_GIB,
    RunningServer,
    offline_chat,
    offline_generate,
    offline_llm,
    server_fixture,
)

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"  # the default model's served name
MAX_TOKENS = 16

server = server_fixture()

CHATS = {
    "cut_by_length": [{"role": "user", "content": "Write one sentence about the sea."}],
    "ends_with_eos": [
        {"role": "user", "content": "What is the capital of France? Answer in one word."}
    ],
    "with_system": [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
}
COMPLETION_PROMPTS = ["The three primary colours are", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.openai_base_url, api_key="not-needed", max_retries=0, timeout=120
    )


def expected_chat(messages: list[dict[str, str]], max_tokens: int = MAX_TOKENS):
    return offline_chat(messages, temperature=0.0, max_tokens=max_tokens)


def expected_completion(prompt: str | list[int], max_tokens: int = MAX_TOKENS):
    """The server encodes a completions prompt like ``tokenizer.encode(text)`` (special tokens added), as
    LLM.generate does for a string."""
    return offline_generate([prompt], temperature=0.0, max_tokens=max_tokens)[0]


def num_chat_prompt_tokens(messages: list[dict[str, str]]) -> int:
    tokenizer = offline_llm().tokenizer
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


# chat ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CHATS))
def test_chat_greedy_answer_equals_offline_engine(client: openai.OpenAI, name: str):
    messages = CHATS[name]
    expected = expected_chat(messages)
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS
    )
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert len(reply.choices) == 1
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert reply.usage.prompt_tokens == num_chat_prompt_tokens(messages)
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_both_finish_reasons_are_covered():
    """The chats above include one cut by max_tokens and one that ends on its own (EOS)."""
    reasons = {
        expected_chat(CHATS[name]).finish_reason for name in ("cut_by_length", "ends_with_eos")
    }
    assert reasons == {"length", "stop"}


@pytest.mark.parametrize("name", list(CHATS))
def test_streamed_chat_equals_offline_engine(client: openai.OpenAI, name: str):
    messages = CHATS[name]
    expected = expected_chat(messages)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    with_choices, usage_chunks = (
        [c for c in chunks if c.choices],
        [c for c in chunks if not c.choices],
    )
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == expected.text
    assert [c.choices[0].finish_reason for c in with_choices] == [None] * (
        len(with_choices) - 1
    ) + [expected.finish_reason]
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0]
    usage = usage_chunks[0].usage
    assert usage.prompt_tokens == num_chat_prompt_tokens(messages)
    assert usage.completion_tokens == len(expected.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_max_completion_tokens_limits_the_answer(client: openai.OpenAI):
    messages = CHATS["cut_by_length"]
    expected = offline_chat(messages, temperature=0.0, max_tokens=5, ignore_eos=True)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_completion_tokens=5,
        extra_body={"ignore_eos": True},  # (an answer that ends sooner would not show the limit)
    )
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5


# completions ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", COMPLETION_PROMPTS)
def test_completion_greedy_text_equals_offline_engine(client: openai.OpenAI, prompt: str):
    expected = expected_completion(prompt)
    reply = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS
    )
    assert reply.object == "text_completion" and len(reply.choices) == 1
    assert reply.choices[0].text == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert reply.usage.prompt_tokens == len(offline_llm().tokenizer.encode(prompt))
    assert reply.usage.completion_tokens == len(expected.token_ids)


def test_streamed_completion_equals_offline_engine(client: openai.OpenAI):
    prompt = COMPLETION_PROMPTS[0]
    expected = expected_completion(prompt)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            temperature=0,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in with_choices) == expected.text
    assert [c.choices[0].finish_reason for c in with_choices] == [None] * (
        len(with_choices) - 1
    ) + [expected.finish_reason]
    assert not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(offline_llm().tokenizer.encode(prompt))


def test_several_prompts_stream_one_choice_each(client: openai.OpenAI):
    expected = [expected_completion(p) for p in COMPLETION_PROMPTS]
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=COMPLETION_PROMPTS,
            temperature=0,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = {i: "" for i in range(len(COMPLETION_PROMPTS))}
    finishes = {i: [] for i in texts}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        finishes[choice.index].append(choice.finish_reason)
    assert [texts[i] for i in sorted(texts)] == [e.text for e in expected]
    for i, reasons in finishes.items():
        assert reasons == [None] * (len(reasons) - 1) + [expected[i].finish_reason]
    assert chunks[-1].usage.completion_tokens == sum(len(e.token_ids) for e in expected)


def test_completion_of_token_ids_equals_offline_engine(client: openai.OpenAI):
    ids = offline_llm().tokenizer.encode(COMPLETION_PROMPTS[1])
    expected = expected_completion(ids)
    reply = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=MAX_TOKENS)
    assert reply.choices[0].text == expected.text
    assert reply.usage.prompt_tokens == len(ids)


# model card, OpenAPI, CLI --------------------------------------------------------------------------


def expected_max_model_len(model_dir: Path) -> int:
    """The KV pool's token capacity under the test budget (float32 K and V per layer), or the model's
    context if smaller."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    block_size, float32_bytes = 16, 4
    bytes_per_block = (
        2
        * config["num_hidden_layers"]
        * block_size
        * config["num_key_value_heads"]
        * head_dim
        * float32_bytes
    )
    pool_tokens = int(float(SMALL_KV_GIB) * 2**30) // bytes_per_block * block_size
    return min(pool_tokens, config["max_position_embeddings"])


# structured output and logit_bias ------------------------------------------------------------------

CITY_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "country"],
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
    },
}


@pytest.mark.parametrize(
    "question",
    [
        "Name a large city in Japan.",
        "Which city is the capital of France?",
        "Tell me about a city you like.",
    ],
)
def test_json_schema_reply_parses_and_validates(client: openai.OpenAI, question: str):
    import jsonschema

    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=120,  # (room for any sampled object of the schema: the grammar ends it)
        temperature=0.7,
        seed=7,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True},
        },
    )
    choice = reply.choices[0]
    # the grammar ended it, not max_tokens
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), CITY_SCHEMA)


def test_json_object_reply_is_one_json_object(client: openai.OpenAI):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_object"},
    )
    content = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert content.lstrip().startswith("{")


def test_logit_bias_forces_the_biased_token(client: openai.OpenAI):
    tokenizer = offline_llm().tokenizer
    forced = tokenizer.encode(" pineapple", add_special_tokens=False)[0]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=3,
        temperature=0,
        logit_bias={str(forced): 100},
    )
    assert reply.choices[0].message.content == tokenizer.decode([forced] * 3)
    unbiased = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=3,
        temperature=0,
    )
    assert unbiased.choices[0].message.content != reply.choices[0].message.content


def test_models_lists_the_served_model(
    server: RunningServer, client: openai.OpenAI, default_model_dir: Path
):
    assert [m.id for m in client.models.list()] == [MODEL]
    body = httpx.get(server.url("/v1/models"), timeout=10).json()
    assert body["object"] == "list" and len(body["data"]) == 1
    card = body["data"][0]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "pagedchat"
    assert isinstance(card["created"], int) and card["created"] > 0
    assert card["max_model_len"] == expected_max_model_len(default_model_dir)


DOCUMENTED_OPERATIONS = [
    ("/v1/chat/completions", "post", "ChatCompletionRequest"),
    ("/v1/completions", "post", "CompletionRequest"),
    ("/v1/models", "get", None),
    ("/health", "get", None),
    ("/metrics", "get", None),
]


def test_openapi_document_has_every_route_and_request_schema(server: RunningServer):
    doc = httpx.get(server.url("/openapi.json"), timeout=10).json()
    assert doc["openapi"].startswith("3.")
    schemas = doc["components"]["schemas"]
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
    assert "prompt" in schemas["CompletionRequest"]["properties"]
    for field in ("temperature", "max_tokens", "stream", "stop"):
        assert field in schemas["ChatCompletionRequest"]["properties"]
    for path, method, body in DOCUMENTED_OPERATIONS:
        operation = doc["paths"][path][method]
        if body is not None:
            ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref == f"#/components/schemas/{body}"
    for ref in _refs(doc):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref


def _refs(node) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


SERVE_OPTIONS = [
    "--host",
    "--port",
    "--model",
    "--served-model-name",
    "--dtype",
    "--device",
    "--block-size",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--max-model-len",
    "--gpu-memory-utilization",
    "--redis-url",
    "--api-key",
    "--max-queue",
]


def test_serve_help_lists_the_promised_options():
    result = subprocess.run(
        [sys.executable, "-m", "app", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    flags = {word.rstrip(",") for word in result.stdout.split() if word.startswith("--")}
    missing = [option for option in SERVE_OPTIONS if option not in flags]
    assert not missing, result.stdout


# the smaller routes ------------------------------------------------------------------------------------------


def test_models_retrieve_gives_the_served_models_card_and_404_for_another(
    server: RunningServer, client: openai.OpenAI
):
    (listed,) = client.models.list().data
    card = client.models.retrieve(listed.id)
    assert card.id == listed.id and card.object == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("org/another-model")
    assert missing.value.body["code"] == "model_not_found"


def test_tokenize_and_detokenize_round_trip_with_the_models_tokenizer(server: RunningServer):
    tokenizer = offline_llm().tokenizer
    text = "The three primary colours are"
    answer = httpx.post(
        server.url("/tokenize"), json={"prompt": text, "return_token_strs": True}, timeout=30
    ).json()
    assert answer["tokens"] == tokenizer.encode(text) and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] > 0 and "".join(answer["token_strs"]) == tokenizer.decode(
        answer["tokens"]
    )
    chat = httpx.post(
        server.url("/tokenize"), json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=30
    ).json()
    assert chat["tokens"] == offline_llm().chat_prompt_ids([{"role": "user", "content": "Hi"}])
    back = httpx.post(
        server.url("/detokenize"), json={"tokens": answer["tokens"]}, timeout=30
    ).json()
    assert back["prompt"] == tokenizer.decode(answer["tokens"])
    for path, body, param in (
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ):
        response = httpx.post(server.url(path), json=body, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (
            response.text
        )


def test_version_and_ping(server: RunningServer):
    assert httpx.get(server.url("/version"), timeout=10).json()["version"]
    assert httpx.get(server.url("/ping"), timeout=10).status_code == 200
    assert httpx.post(server.url("/ping"), timeout=10).status_code == 200


def test_chat_template_kwargs_reach_the_template_and_reserved_names_are_refused(
    server: RunningServer,
):
    messages = [{"role": "user", "content": "Hi"}]
    plain = httpx.post(server.url("/tokenize"), json={"messages": messages}, timeout=30).json()[
        "tokens"
    ]
    body = {
        "messages": messages,
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    # the default model's template ignores variables it does not use: the prompt is the same, the request served
    served = httpx.post(
        server.url("/v1/chat/completions"),
        json={**body, "chat_template_kwargs": {"enable_thinking": False}},
        timeout=60,
    )
    assert served.status_code == 200 and served.json()["usage"]["prompt_tokens"] == len(plain)
    for kwargs, say in (
        ({"add_generation_prompt": False}, "set by the server"),
        ({"x": {"nested": 1}}, "x"),
        ({"bad-name": 1}, "chat_template_kwargs"),
    ):
        refused = httpx.post(
            server.url("/v1/chat/completions"),
            json={**body, "chat_template_kwargs": kwargs},
            timeout=30,
        )
        assert refused.status_code == 400 and say in refused.text, refused.text


def test_an_unknown_field_is_ignored_and_logged_once(server: RunningServer):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "frobnicate_level": 3}
    for _ in range(3):
        assert (
            httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60).status_code == 200
        )
    assert server.log().count("'frobnicate_level' is not supported and was ignored") == 1


async def test_template_kwargs_are_variables_of_the_chat_template():
    import copy

    from app.prompts import PromptRenderer

    tokenizer = copy.deepcopy(offline_llm().tokenizer)
    tokenizer.chat_template = (
        "{% if shout %}LOUD {% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    renderer = PromptRenderer(tokenizer)
    try:
        messages = [{"role": "user", "content": "hello"}]
        quiet, loud = await renderer.chat(messages), await renderer.chat(messages, {"shout": True})
    finally:
        renderer.close()
    assert tokenizer.decode(quiet) == "hello" and tokenizer.decode(loud) == "LOUD hello"
