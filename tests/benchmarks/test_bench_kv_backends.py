"""benchmarks.offline.kv_backends on the CPU (the paged backend on a tiny dummy architecture), its allocation
arithmetic, its refusal of vattention without CUDA, and the chart it feeds."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.kernel.decode_attention import HEAD_DIM, HEADS, KV_HEADS
from benchmarks.offline.kv_backends import allocation, contiguous_inputs, main
from engine.worker.dummy_model import DUMMY_ARCHITECTURES
from kernels import reference

# the shapes of the dummy llama-3.2-1b, shrunk so that a CPU engine starts and steps in about a second (the
# 0.6B qwen3-0.6b takes ~40 s on 2 cores); the vocabulary still covers the nano prompt ids [0, 10000)
TINY = dict(
    DUMMY_ARCHITECTURES["llama-3.2-1b"],
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=10_240,
    intermediate_size=128,
    bos_token_id=1,
    eos_token_id=2,
)
SMOKE = [
    "--device",
    "cpu",
    "--num-requests",
    "2",
    "--max-prompt-len",
    "8",
    "--max-output-len",
    "4",
    "--no-kernel",
    "--sample-every",
    "1",
]


@pytest.fixture
def tiny_arch(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(DUMMY_ARCHITECTURES, "tiny-llama", TINY)
    return "tiny-llama"


def test_paged_row_reports_throughput_and_a_useful_share(tiny_arch, tmp_path):
    path = tmp_path / "kv.json"
    main([*SMOKE, "--backends", "paged", "--model-configs", tiny_arch, "--json", str(path)])
    (row,) = json.loads(path.read_text())["nano"]
    assert (row["model"], row["backend"], row["error"]) == (tiny_arch, "paged", None)
    assert row["output_tokens"] == 2 * 4 and row["tok_s"] > 0
    # each request holds at most 8 prompt + 4 output tokens in one block of 16: both fit, at most 12/16 useful
    assert 0 < row["useful"] <= 12 / 16
    assert row["peak_blocks"] == 2 and row["max_running"] == 2 and row["preemptions"] == 0
    assert row["allocation"] is None  # the paged backend maps nothing


def test_vattention_without_cuda_is_refused_by_the_engine_config(tiny_arch):
    with pytest.raises(ValueError, match="kv_backend"):
        main([*SMOKE, "--backends", "paged", "vattention", "--model-configs", tiny_arch])


def test_allocation_latency_per_page_group_and_per_driver_call():
    before = {"maps": 10, "unmaps": 4, "map_seconds": 1.0, "unmap_seconds": 0.5, "mapped_pages": 3}
    after = {
        "maps": 14,
        "unmaps": 6,
        "map_seconds": 1.008,
        "unmap_seconds": 0.502,
        "mapped_pages": 5,
    }
    got = allocation(before, after, num_layers=16)
    # 4 groups in 8 ms: 2000 us each; a group is K and V of 16 layers = 32 driver calls: 62.5 us each
    assert (
        got["maps"] == 4
        and got["map_us"] == pytest.approx(2000)
        and got["map_call_us"] == pytest.approx(62.5)
    )
    assert got["unmaps"] == 2 and got["unmap_us"] == pytest.approx(1000)
    assert got["unmap_call_us"] == pytest.approx(31.25)
    assert allocation({}, {}, num_layers=16) is None


def test_contiguous_layout_holds_the_same_kv_as_the_permuted_blocks():
    batch, context, block = 3, 48, 16
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (
        torch.randn(batch * 3, block, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2)
    )
    tables = torch.randperm(batch * 3, generator=gen).view(batch, 3).to(torch.int32)
    paged = {
        "query": torch.randn(batch, HEADS, HEAD_DIM, generator=gen),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": tables,
        "context_lens": torch.full((batch,), context, dtype=torch.int32),
    }
    slots = contiguous_inputs(paged, context)
    assert slots["k_slots"].shape == (2 * batch, context, KV_HEADS, HEAD_DIM)
    assert len(set(slots["slot_ids"].tolist())) == batch
    b, position = 1, 20  # position 20 = block table entry 1, offset 4
    assert torch.equal(slots["v_slots"][slots["slot_ids"][b], position], v_cache[tables[b, 1], 4])
    expected, got = torch.empty(batch, HEADS, HEAD_DIM), torch.empty(batch, HEADS, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    reference.paged_attention(
        expected, paged["query"], k_cache, v_cache, tables, paged["context_lens"], scale
    )
    reference.contiguous_decode_attention(
        got,
        slots["query"],
        slots["k_slots"],
        slots["v_slots"],
        slots["slot_ids"],
        slots["context_lens"],
        scale,
        max_context=context,
    )
    torch.testing.assert_close(got, expected)


def test_chart_renders_both_backends_and_the_kernel_panel(tmp_path):
    pytest.importorskip(
        "matplotlib", reason="matplotlib is not installed (the chart is drawn where it is)"
    )
    from benchmarks.offline.kv_backends_chart import main as chart_main

    rows = [
        {"model": m, "backend": b, "error": None, "tok_s": t, "useful": u}
        for m, b, t, u in [
            ("llama-3.2-1b", "paged", 12000, 0.97),
            ("llama-3.2-1b", "vattention", 12500, 0.55),
            ("qwen3-0.6b", "paged", 9000, 0.96),
        ]
    ]
    rows.append({"model": "qwen3-0.6b", "backend": "vattention", "error": "DriverError: cuMemMap"})
    kernel = [{"batch": 32, "context": 8192, "paged_gbps": 3900.0, "contiguous_gbps": 4100.0}]
    data = {
        "workload": {"num_requests": 256, "max_model_len": 4096},
        "nano": rows,
        "kernel": kernel,
        "environment": {"device": "NVIDIA H200", "date": "2026-11-24T10:00:00+00:00"},
    }
    source, out = tmp_path / "kv.json", tmp_path / "kv.png"
    source.write_text(json.dumps(data))
    chart_main([str(source), "--out", str(out)])
    assert out.stat().st_size > 0
