"""EngineConfig's device-dependent step limits (vLLM's rule: larger on GPUs of >= 70 GiB that are not A100s)."""
from types import SimpleNamespace

import pytest
import torch

from engine import config as config_module
from engine.config import EngineConfig, is_large_gpu


@pytest.mark.parametrize(("name", "gib", "large"), [
    ("NVIDIA H200", 139, True), ("NVIDIA H100 80GB HBM3", 79.2, True), ("NVIDIA A100-SXM4-80GB", 79.2, False),
    ("NVIDIA L4", 22, False), ("NVIDIA GeForce RTX 4090", 24, False),
])
def test_large_gpu_rule(monkeypatch, name, gib, large):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(name=name, total_memory=int(gib * 2**30)))
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
