"""The model's generation_config.json sampling defaults apply to requests that leave those fields unset
(``--generation-config auto``, vLLM's behaviour); a request's own values win; ``none`` keeps OpenAI's defaults;
values out of range in the file are never applied."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from app.generation_config import model_sampling_defaults
from app.protocol.completions import CompletionRequest
from app.server import create_app
from app.settings import ServerSettings
from engine.config import EngineConfig
from tests.engine.test_models import tiny_hf_model


def write_config(directory: Path, **values) -> Path:
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **values}))
    return directory


def test_the_files_sampling_fields_are_read_and_bad_ones_skipped(tmp_path, caplog):
    write_config(
        tmp_path,
        temperature=0.6,
        top_p=0.95,
        top_k=20,
        min_p=0,
        repetition_penalty=float("inf"),
        max_new_tokens=100,
        do_sample=True,
    )
    with caplog.at_level(logging.WARNING):
        defaults = model_sampling_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
    assert "repetition_penalty" in caplog.text
    assert (
        model_sampling_defaults(str(tmp_path / "missing")) == {}
        and model_sampling_defaults(None) == {}
    )
    write_config(tmp_path, top_p=1.5, temperature="hot")
    assert model_sampling_defaults(str(tmp_path)) == {}


def test_a_requests_own_values_win_over_the_defaults():
    defaults = {"temperature": 0.6, "top_k": 20}
    bare = CompletionRequest(prompt=[1, 2, 3]).sampling_params(3, 100, 10, defaults)
    assert (bare.temperature, bare.top_k) == (0.6, 20)
    own = CompletionRequest(prompt=[1, 2, 3], temperature=0.0).sampling_params(3, 100, 10, defaults)
    assert (own.temperature, own.top_k) == (0.0, 20)
    plain = CompletionRequest(prompt=[1, 2, 3]).sampling_params(3, 100, 10)
    assert plain.temperature == 1.0 and plain.top_k in (0, -1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory: Path = tmp_path_factory.mktemp("tiny-llama-greedy-by-default")
    tiny_hf_model("llama").save_pretrained(directory)
    return write_config(directory, temperature=0.0)  # the model asks for greedy decoding


@pytest.mark.parametrize(("mode", "same"), [("auto", True), ("none", False)])
def test_the_model_default_reaches_requests_unless_turned_off(
    model_dir: Path, mode: str, same: bool
):
    settings = ServerSettings(
        session_store="memory",
        generation_config=mode,
        engine=EngineConfig(model=str(model_dir), num_kv_blocks=64),
    )
    with TestClient(create_app(settings)) as client:
        outputs = []
        for seed in (1, 2, 3):
            body = {
                "prompt": [5, 17, 200, 3],
                "max_tokens": 16,
                "ignore_eos": True,
                "seed": seed,
                "return_token_ids": True,
            }
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            outputs.append(tuple(response.json()["choices"][0]["token_ids"]))
    assert (len(set(outputs)) == 1) is same, outputs  # greedy: one answer whatever the seed
