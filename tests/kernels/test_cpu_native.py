"""The native CPU kernels (kernels/cpu_decode.cpp, kernels/cpu_quant_matmul.cpp) against the Python path they
replace and against float64 references of their schemes, at every instruction-set level this CPU can run
(kernels/cpu_native.py: generic, avx2, avx512, avx512_vnni; a level it lacks is skipped, naming the level), and the
lean Python decoder (engine/models/cpu_decoder.py) against the model's modules. The GGUF formats' matmul itself:
tests/kernels/test_gguf_kernels.py.

The native decode step sums in its own order (norms, attention, the exp of SiLU and softmax), so it is held to the
Python path within float32 rounding; a wrong index, rotation or cache slot moves values by whole units. The lean
Python decoder only skips conversions whose values are exact, so it must equal the module path bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.config import CPU_ISA_CHOICES, EngineConfig
from engine.forward_context import get_attention_metadata
from engine.layers.quantized_linear import (
    PACKED_OUTPUTS,
    PackedInt8Head,
    Q4Linear,
    cpu_linear,
    cpu_logits_head,
)
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kernels import cpu_native
from tests.engine.test_models import tiny_hf_model

if os.environ.get("PAGEDCHAT_CPU_NATIVE") == "0":
    pytest.skip(
        "PAGEDCHAT_CPU_NATIVE=0: the native CPU kernels are switched off", allow_module_level=True
    )


BUILD_ROOT = Path(EngineConfig().cache_dir) / "native"
LEVELS = ("generic", *cpu_native.ISA_LEVELS)  # every level this project ships


@pytest.fixture(scope="module", autouse=True)
def native_built() -> None:
    """The kernels must build here (CI has a C++ compiler); a failed build is a failure, not a skip."""
    assert cpu_native.load(BUILD_ROOT) is not None, "the native CPU kernels did not build"


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    """Two torch threads here whatever the suite's (tests/conftest.py): the kernels' parallel tasks (attention's
    spans and runs of rows, the matmuls' columns) run on both, so their results are checked as the server runs
    them."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def kernels_at(level: str) -> cpu_native.CpuKernels:
    """The kernels of ``level``, built for it; a level this CPU lacks cannot run here (skipped, named)."""
    if level != "generic" and level not in cpu_native.supported_levels():
        pytest.skip(
            f"this CPU cannot run {level} code (levels it has: {cpu_native.supported_levels()})"
        )
    native = cpu_native.load(BUILD_ROOT, level)
    assert native is not None, f"the {level} kernels did not build"
    return native


@pytest.fixture(params=LEVELS)
def native(request) -> cpu_native.CpuKernels:
    """The kernels of each instruction-set level (every kernel exists at every level)."""
    return kernels_at(request.param)


# ---------------------------------------------------------------- levels


@pytest.mark.parametrize("level", LEVELS)
def test_each_level_is_compiled_for_its_own_instruction_set(level: str):
    assert str(kernels_at(level).ops.isa()) == level


def test_auto_takes_the_highest_level_the_cpu_has():
    levels = cpu_native.supported_levels()
    assert cpu_native.resolve_isa("auto") == (levels[-1] if levels else "generic")
    assert cpu_native.load(BUILD_ROOT).level == cpu_native.resolve_isa("auto")


def test_a_level_the_cpu_lacks_is_refused_naming_the_field(monkeypatch):
    avx2_only = set(cpu_native._X86_64_V3) | {"sse4_2"}
    monkeypatch.setattr(cpu_native, "_cpu_flags", lambda: avx2_only)
    assert cpu_native.supported_levels() == ["avx2"]
    for level in ("avx512", "avx512_vnni"):
        with pytest.raises(ValueError, match=f"cpu_isa: this CPU cannot run {level} code .*avx512"):
            cpu_native.load(BUILD_ROOT, level)  # refused before any build or load: never SIGILL
        with pytest.raises(ValueError, match="cpu_isa"):
            EngineConfig(cpu_isa=level, device="cpu").resolve()
    assert cpu_native.resolve_isa("auto") == "avx2"
    monkeypatch.setattr(cpu_native, "_cpu_flags", lambda: {"sse2"})
    assert cpu_native.resolve_isa("auto") == "generic"
    assert cpu_native.resolve_isa("generic") == "generic"  # (every CPU runs the generic build)
    with pytest.raises(ValueError, match="cpu_isa"):
        cpu_native.resolve_isa("avx2")


@pytest.mark.parametrize("value", ["avx", "AVX2", "native", ""])
def test_an_unknown_level_is_refused(value: str):
    """(at construction: EngineConfig's own list of levels, kept equal to the kernels')"""
    assert CPU_ISA_CHOICES == cpu_native.CPU_ISA_CHOICES
    with pytest.raises(
        ValueError, match="cpu_isa: must be one of auto, generic, avx2, avx512, avx512_vnni"
    ):
        EngineConfig(cpu_isa=value)


def test_each_checkout_builds_into_a_directory_of_its_own(tmp_path: Path):
    """torch rebuilds a build directory whose sources come from another path: two installs on one machine that
    shared one rebuilt each other's kernels at every start (~15 s, silently)."""
    here = cpu_native.build_directory(tmp_path, "x86-64-v3", Path(cpu_native.__file__).parent)
    again = cpu_native.build_directory(tmp_path, "x86-64-v3", Path(cpu_native.__file__).parent)
    other = cpu_native.build_directory(tmp_path, "x86-64-v3", tmp_path / "another-checkout")
    level = cpu_native.build_directory(tmp_path, "x86-64-v4", Path(cpu_native.__file__).parent)
    assert here == again and len({here, other, level}) == 3
    assert here.parent == tmp_path and torch.__version__.split("+")[0] in here.name


def test_the_environment_variable_sets_the_level(monkeypatch):
    monkeypatch.setenv("PAGEDCHAT_CPU_ISA", "avx2")
    if "avx2" not in cpu_native.supported_levels():
        with pytest.raises(ValueError, match="cpu_isa"):
            EngineConfig()
        return
    assert EngineConfig().cpu_isa == "avx2"


def test_every_level_gives_the_same_floats():
    """The integer sums are exact and the float steps the same per output at every level: bit-equal results
    (the q4 layers and the Q8_0 output layer here; every GGUF format: tests/kernels/test_gguf_kernels.py)."""
    levels = [kernels_at(level) for level in ("generic", *cpu_native.supported_levels())]
    torch.manual_seed(3)
    weight, head_weight = torch.randn(96, 256), torch.randn(64, 256)
    for rows in (1, 4, 5, 8, 13):
        x = torch.randn(rows, 256) * torch.logspace(-1, 1, 256)
        q4 = [cpu_linear("q4", weight, None, native=k)(x) for k in levels]
        q8 = [cpu_logits_head("q4", head_weight, None, k)(x) for k in levels]
        assert all(torch.equal(q4[0], out) for out in q4) and all(
            torch.equal(q8[0], out) for out in q8
        )


# ---------------------------------------------------------------- the output layer


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17])
def test_packed_int8_head_equals_its_int8_weights_in_float64(rows: int, native):
    torch.manual_seed(rows)
    weight = (
        torch.randn(8 * PACKED_OUTPUTS, 96) * torch.logspace(-2, 0, 8 * PACKED_OUTPUTS)[:, None]
    )
    head = PackedInt8Head(weight, native)
    codes = head.packed.transpose(1, 2).reshape(weight.shape)  # back to [out, in]
    assert int(codes.abs().max()) == 127, "each row's largest weight takes the largest code"
    x = torch.randn(rows, 96)
    expected = x.double() @ (codes.double() * head.scales.double()[:, None]).t()
    got = head(x)
    assert got.dtype == torch.float32 and got.shape == (rows, weight.shape[0])
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    # the stored weights are the weight within half an int8 step per row
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert bool(((codes.float() * head.scales[:, None] - weight).abs() <= step / 2 + 1e-7).all())


def test_packed_int8_head_gives_a_row_the_same_logits_in_any_batch(native):
    torch.manual_seed(7)
    head = PackedInt8Head(torch.randn(4 * PACKED_OUTPUTS, 128), native)
    x = torch.randn(11, 128)
    alone = torch.cat([head(x[i : i + 1]) for i in range(11)])
    assert torch.equal(head(x), alone)
    assert torch.equal(head(x[3:9]), alone[3:9])


def test_packed_int8_head_rejects_ragged_outputs():
    with pytest.raises(ValueError, match="cpu_weights"):
        PackedInt8Head(torch.randn(PACKED_OUTPUTS + 1, 32), cpu_native.load(BUILD_ROOT))


# ---------------------------------------------------------------- the decoder, step by step


class TwoPaths:
    """Stands in for the model's ``cpu_decoder``: each pass runs ``first`` and ``second`` from the same KV
    cache state, records how far apart their hidden states and written KV are, and goes on with ``second``'s."""

    def __init__(self, model: torch.nn.Module, first, second) -> None:
        self.attention = model.attention_layers
        self.first, self.second = first, second
        self.passes: list[dict] = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        before = [(a.k_cache.clone(), a.v_cache.clone()) for a in self.attention]
        first = self.first(input_ids, positions)
        after_first = [(a.k_cache.clone(), a.v_cache.clone()) for a in self.attention]
        for attn, (k, v) in zip(self.attention, before):
            attn.k_cache.copy_(k)
            attn.v_cache.copy_(v)
        meta.memo.clear()
        second = self.second(input_ids, positions)
        kv_diff = max(
            max(float((a.k_cache - k).abs().max()), float((a.v_cache - v).abs().max()))
            for a, (k, v) in zip(self.attention, after_first)
        )
        written = max(
            max(float((a.k_cache - k).abs().max()), float((a.v_cache - v).abs().max()))
            for a, (k, v) in zip(self.attention, before)
        )
        self.passes.append(
            {
                "decode": meta.num_decodes == input_ids.shape[0],
                "rows": input_ids.shape[0],
                "longest": int(meta.context_lens.max()),
                "equal": torch.equal(first, second),
                "hidden_diff": float((first - second).abs().max()),
                "hidden_scale": float(second.abs().max()),
                "kv_diff": kv_diff,
                "kv_written": written,
            }
        )
        return second


@pytest.fixture(params=LEVELS)
def kernel(request, monkeypatch) -> str:
    """The native step on the kernels of each level."""
    kernels_at(request.param)
    monkeypatch.setenv("PAGEDCHAT_CPU_ISA", request.param)
    return request.param


def tiny_q4_llm(tmp_path: Path, **options) -> LLM:
    tiny_hf_model("llama").save_pretrained(tmp_path)
    return LLM(
        model=str(tmp_path),
        cpu_weights="q4",
        num_kv_blocks=96,
        max_num_batched_tokens=512,
        num_threads=2,  # (fixed: the tuner of an unset count could move it, engine/worker/cpu_threads.py)
        **options,
    )


def python_path(decoder):
    def run(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        native, decoder.native_step = decoder.native_step, None
        try:
            return decoder.forward(input_ids, positions)
        finally:
            decoder.native_step = native

    return run


# prompts of 5..300 tokens: contexts beyond one attention span (64) of the native step's split
PROMPTS = [
    [5, 17, 200, 3, 9],
    list(range(30, 90)),
    [(7 * i) % 311 + 2 for i in range(300)],
    [11] * 140,
]


def test_native_steps_follow_the_python_path(tmp_path: Path, kernel: str):
    llm = tiny_q4_llm(tmp_path)
    model = llm.engine.model
    decoder = model.cpu_decoder
    assert decoder.native_step is not None, (
        "the tiny llama (4-bit, no biases) takes the native step"
    )
    model.cpu_decoder = recorder = TwoPaths(model, decoder.forward, python_path(decoder))
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    decodes = [p for p in recorder.passes if p["decode"]]
    assert len(decodes) >= 23 and max(p["rows"] for p in decodes) == len(PROMPTS)
    assert max(p["longest"] for p in decodes) > 300, "a context longer than four attention spans"
    prefills = [p for p in recorder.passes if not p["decode"]]
    assert prefills and max(p["rows"] for p in prefills) > 300, (
        "prompts go through the native step too"
    )
    for p in recorder.passes:
        assert p["kv_written"] > 0.1, "the step writes its tokens' keys and values"
        # measured: ~1e-6, and 4e-3 where the two paths' attention, rounding apart by ~1e-7, put one activation
        # of a q8-quantized matmul on either side of a code (one code step in the next layer's K); a wrong index,
        # rotation or slot moves whole units
        assert p["kv_diff"] <= 1e-2 * max(1.0, p["kv_written"]), p
        # measured: 4.7e-7
        assert p["hidden_diff"] <= 0.01 * p["hidden_scale"], p


@pytest.mark.parametrize("layers", ["native", "torch-int4"])
def test_lean_python_decoder_equals_the_modules_bit_for_bit(
    tmp_path: Path, layers: str, monkeypatch
):
    """With the native GGUF layers, and with torch's int4 layers (where no native kernels were built: forced
    here by hiding them)."""
    if layers == "torch-int4":
        monkeypatch.setattr(cpu_native, "load", lambda *args: None)
    llm = tiny_q4_llm(tmp_path)
    model = llm.engine.model
    assert isinstance(model.model.layers[0].mlp.down_proj, Q4Linear) == (layers == "torch-int4")
    decoder = model.cpu_decoder
    model.cpu_decoder = recorder = TwoPaths(model, model.model.forward, python_path(decoder))
    llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert any(p["decode"] for p in recorder.passes) and any(
        not p["decode"] for p in recorder.passes
    )
    assert all(p["equal"] and p["kv_diff"] == 0.0 for p in recorder.passes), recorder.passes


def test_native_and_python_engines_agree_on_greedy_tokens(tmp_path: Path, kernel: str):
    """Over whole generations the two paths' rounding differences may part a near-tie late, not early."""
    native = tiny_q4_llm(tmp_path / "native")
    python = tiny_q4_llm(tmp_path / "python")
    python.engine.model.cpu_decoder.native_step = None
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ours, theirs = native.generate(PROMPTS, params), python.generate(PROMPTS, params)
    firsts = [
        next((i for i, (a, b) in enumerate(zip(o.token_ids, t.token_ids)) if a != b), 16)
        for o, t in zip(ours, theirs)
    ]
    assert min(firsts) >= 4 and sum(firsts) / len(firsts) >= 10, firsts


@pytest.mark.parametrize("level", LEVELS)
def test_greedy_output_does_not_depend_on_load(tmp_path: Path, level: str, monkeypatch):
    """A token's numbers are the same whether its sequence runs alone or among others, its prompt in one step
    or in chunks, with its prefix cached, or recomputed after preemption (issue 22: temperature-0 requests must
    not change under load): token ids and logprobs equal bit for bit."""
    kernels_at(level)
    monkeypatch.setenv("PAGEDCHAT_CPU_ISA", level)
    tiny_hf_model("llama").save_pretrained(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)

    def run(prompts: list[list[int]], llm: LLM | None = None, **options) -> tuple[LLM, list]:
        options = {"num_kv_blocks": 96, "num_threads": 2, **options}
        llm = llm or LLM(model=str(tmp_path), cpu_weights="q4", **options)
        return llm, llm.generate(prompts, params)

    def tokens(outputs: list) -> list[tuple[list[int], list]]:
        return [(o.token_ids, o.logprobs) for o in outputs]

    alone = [tokens(run([prompt], enable_prefix_caching=False)[1])[0] for prompt in PROMPTS]
    assert tokens(run(PROMPTS, enable_prefix_caching=False)[1]) == alone, "a batch of four"
    chunked = run(PROMPTS, max_num_batched_tokens=48, enable_prefix_caching=False)[1]
    assert tokens(chunked) == alone, "prompts in chunks of up to 48 tokens"
    cache = run(PROMPTS[2:])[0]
    outputs = run(PROMPTS, cache)[1]
    assert tokens(outputs) == alone and outputs[2].num_cached_tokens >= 288, (
        "prompts from the prefix cache"
    )
    squeezed, outputs = run(
        PROMPTS, num_kv_blocks=24, preemption_mode="recompute", enable_prefix_caching=False
    )
    assert squeezed.engine.scheduler.num_preemptions > 0, (
        "24 blocks of 16 cannot hold the four at once"
    )
    assert tokens(outputs) == alone, "recomputed after preemption"
