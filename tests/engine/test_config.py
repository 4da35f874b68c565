"""EngineConfig's device-dependent step limits (vLLM's rule: larger on GPUs of >= 70 GiB that are not A100s)."""

import os
from types import SimpleNamespace

import pytest
import torch

from engine import config as config_module
from engine.config import EngineConfig, is_large_gpu


@pytest.mark.parametrize(
    ("name", "gib", "large"),
    [
        ("NVIDIA H200", 139, True),
        ("NVIDIA H100 80GB HBM3", 79.2, True),
        ("NVIDIA A100-SXM4-80GB", 79.2, False),
        ("NVIDIA L4", 22, False),
        ("NVIDIA GeForce RTX 4090", 24, False),
    ],
)
def test_large_gpu_rule(monkeypatch, name, gib, large):
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device: SimpleNamespace(name=name, total_memory=int(gib * 2**30)),
    )
    assert is_large_gpu(torch.device("cuda", 0)) is large


def test_cpu_defaults_and_explicit_limits_win(monkeypatch):
    config = EngineConfig(device="cpu")
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (256, 2048)
    monkeypatch.setattr(config_module, "is_large_gpu", lambda device: True)
    config = EngineConfig(device="cpu")
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (1024, 8192)
    config = EngineConfig(device="cpu", max_num_seqs=7, max_num_batched_tokens=96)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (7, 96)


@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens"])
def test_limits_below_one_are_refused(field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(device="cpu", **{field: 0})


def test_dummy_weights_for_a_model_directory(tmp_path):
    """load_format=dummy with a directory holding only config.json (a tiny model for server load tests): the
    config is read as a namespace and still gives transformers' parameter names and shapes."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from tests.two_layer_llama import two_layer_llama_dir

    two_layer_llama_dir(  # (shrunk to one layer, 32 wide)
        tmp_path,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=300,
        intermediate_size=64,
        rope_theta=10000.0,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    llm = LLM(model=str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=16)
    assert llm.engine.tokenizer is None
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and all(0 <= t < 300 for t in out.token_ids)


@pytest.mark.parametrize("given", [None, "ACTIVE"])
def test_openmp_threads_sleep_at_barriers_unless_the_user_chose(given: str | None):
    """Importing the engine sets OMP_WAIT_POLICY=PASSIVE before torch loads libgomp (a spinning thread starves its
    sibling on a shared CPU, issue 49) and keeps a policy the user set."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    # (engine first, torch after it, as every engine module that needs torch imports it)
    code = "import os, sys, engine; assert 'torch' not in sys.modules; import torch; print(os.environ['OMP_WAIT_POLICY'])"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (given or "PASSIVE")
