"""A model without a tokenizer (dummy or bare weights, as on the GPU benchmark machines): /v1/completions takes
token ids and streams every generated token (an event per engine step, or several steps' tokens in one event when
the reader is behind); ``return_token_ids`` shows them; text-only requests get a 400 naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from app.server import create_app
from app.settings import ServerSettings
from engine.config import EngineConfig
from tests.engine.test_models import tiny_hf_model


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model_dir: Path = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf_model("llama").save_pretrained(model_dir)  # weights and config, no tokenizer files
    settings = ServerSettings(
        session_store="memory", engine=EngineConfig(model=str(model_dir), num_kv_blocks=64)
    )
    with TestClient(create_app(settings)) as client:
        yield client


def test_token_id_prompts_stream_every_token(client: TestClient):
    body = {
        "prompt": [5, 17, 200, 3],
        "max_tokens": 6,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "logprobs": 1,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        payloads = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    token_chunks = [c for c in chunks if c["choices"]]
    assert (
        1 <= len(token_chunks) <= 6 and token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    )
    assert all(c["choices"][0]["token_ids"] for c in token_chunks)  # no event without a token
    ids = [t for c in token_chunks for t in c["choices"][0]["token_ids"]]
    tokens = [t for c in token_chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == [f"token_id:{t}" for t in ids] and len(ids) == 6
    whole = client.post("/v1/completions", json={**body, "stream": False}).json()
    assert whole["choices"][0]["token_ids"] == ids  # greedy: the same tokens, all at once
    assert (
        chunks[-1]["usage"]["completion_tokens"] == 6 and chunks[-1]["usage"]["prompt_tokens"] == 4
    )


def test_token_ids_are_shown_only_when_asked(client: TestClient):
    body = {"prompt": [5, 17, 200, 3], "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    assert "token_ids" not in client.post("/v1/completions", json=body).json()["choices"][0]
    refused = client.post("/v1/completions", json={**body, "return_token_ids": "yes"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "return_token_ids"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ("/v1/completions", {"prompt": "text needs a tokenizer"}, "prompt"),
    ],
)
def test_text_requests_are_a_clear_400(client: TestClient, path: str, body: dict, param: str):
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert (
        response.json()["error"]["param"] == param
        and "tokenizer" in response.json()["error"]["message"]
    )
