"""EngineConfig: its options checked at construction without torch, the device-dependent fields filled by
``resolve()`` (step limits: vLLM's rule, larger on GPUs of >= 70 GiB that are not A100s)."""

import os
from types import SimpleNamespace

import pytest
import torch

from engine import config as config_module
from engine import device_defaults
from engine.config import EngineConfig
from engine.device_defaults import is_large_gpu


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
    # (unresolved: the device's defaults are left to the engine that runs on it)
    assert (config.max_num_seqs, config.torch_device, config.torch_dtype) == (None, None, None)
    assert config.resolve() is config
    # (the dtype names the options accept are the ones resolve() maps: two lists, as engine.config imports no torch)
    assert tuple(device_defaults._DTYPES) == config_module.DTYPES
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (256, 2048)
    assert (config.torch_device, config.torch_dtype) == (torch.device("cpu"), torch.float32)
    assert (config.async_scheduling, config.step_time_target_s, config.max_graph_batch_size) == (
        False,
        0.25,
        0,
    )
    monkeypatch.setattr(device_defaults, "is_large_gpu", lambda device: True)
    config = EngineConfig(device="cpu").resolve()
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (1024, 8192)
    config = EngineConfig(device="cpu", max_num_seqs=7, max_num_batched_tokens=96).resolve()
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (7, 96)


def test_construction_imports_no_torch_and_resolve_checks_the_device():
    """The front builds, checks and sends a config without torch (its start does not pay torch's import); the
    options a device cannot run are refused where the engine resolves them."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from engine.config import EngineConfig\n"
        "c = EngineConfig(device='cpu', dtype='bfloat16', max_num_seqs=3)\n"
        "try:\n"
        "    EngineConfig(cpu_weights='int8', dtype='bfloat16')\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "cpu_weights: int8 weights compute with float32 activations: use dtype float32 (or auto)",
        "False",
    ]
    with pytest.raises(ValueError, match="kv_backend: vattention needs a CUDA device"):
        EngineConfig(device="cpu", kv_backend="vattention").resolve()
    with pytest.raises(ValueError, match="device: 'tpu:0' is not a torch device|device: must be"):
        EngineConfig(device="tpu:0").resolve()
    with pytest.raises(ValueError, match="cpu_isa: must be one of"):
        EngineConfig(device="cpu", cpu_isa="sse9").resolve()


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
