"""``--model`` takes a local Hugging Face directory, a local .gguf file (its config and tokenizer described once into the cache dir, the weights read from the file) or a
hub id (huggingface_hub: downloaded when online, the hub cache with HF_HUB_OFFLINE=1; here a cache the test
builds, no network); anything else is one line and exit status 2 before any weights load."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

import engine.worker.model_sources as model_sources
from tests.server_harness import REPO_ROOT, free_port, running_server, server_command, server_env
from tests.engine.test_models import tiny_hf_model

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A Hugging Face hub cache holding testorg/tiny-llama at one revision, as huggingface_hub lays it out."""
    cache: Path = tmp_path_factory.mktemp("hub")
    repo = cache / "models--testorg--tiny-llama"
    tiny_hf_model("llama").save_pretrained(repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return cache


def test_a_hub_id_is_served_from_the_hub_cache_offline(hub_cache: Path):
    env = {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    with running_server("testorg/tiny-llama", "--num-kv-blocks", "64", env=env) as server:
        (card,) = httpx.get(server.url("/v1/models"), timeout=10).json()["data"]
        assert card["id"] == "testorg/tiny-llama"
        body = {
            "prompt": [5, 17, 200],
            "max_tokens": 4,
            "ignore_eos": True,
            "temperature": 0,
            "return_token_ids": True,
        }
        answer = httpx.post(server.url("/v1/completions"), json=body, timeout=60).json()
        assert len(answer["choices"][0]["token_ids"]) == 4


def test_an_unknown_hub_id_offline_is_one_line_and_status_2(hub_cache: Path):
    env = server_env({"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"})
    result = subprocess.run(
        server_command(free_port(), ["testorg/no-such-model"]),
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "testorg/no-such-model is no local path" in errors[0]
    assert "HF_HUB_OFFLINE" in errors[0] and "Traceback" not in result.stderr


def test_a_gguf_file_is_described_once_per_version_of_the_file(tmp_path, monkeypatch):
    """Its config and tokenizer are written once into the cache (the weights stay in the file); an edited file
    (another size or modification time) gets a directory of its own."""
    import engine.weights.gguf_model_dir as gguf_model_dir

    described = []

    def describe(gguf_file: Path, target: Path) -> None:
        described.append(target)
        target.mkdir(parents=True)
        (target / gguf_model_dir.GGUF_LINK).write_text(str(gguf_file))

    monkeypatch.setattr(gguf_model_dir, "_describe", describe)
    gguf = tmp_path / "my-model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    first = model_sources.resolve_model(str(gguf), tmp_path / "cache")
    assert (
        model_sources.resolve_model(str(gguf), tmp_path / "cache") == first and len(described) == 1
    )
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("my-model.Q4_1-")
    assert gguf_model_dir.gguf_file_of(first) == gguf.resolve()
    os.utime(gguf, ns=(1, 1))  # another version of the file: described again, elsewhere
    assert (
        model_sources.resolve_model(str(gguf), tmp_path / "cache") != first and len(described) == 2
    )


def test_what_is_neither_says_what_is_accepted(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="not a .gguf file"):
        model_sources.resolve_model(str(tmp_path / "notes.txt"), tmp_path)
    with pytest.raises(
        ValueError, match="a local Hugging Face model directory, a .gguf file, or a hub id"
    ):
        model_sources.resolve_model(str(tmp_path / "missing"), tmp_path)
    # a directory is taken as it is
    assert model_sources.resolve_model(str(tmp_path), tmp_path) == tmp_path
