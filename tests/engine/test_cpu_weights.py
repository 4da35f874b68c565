"""``cpu_weights``: the quantized CPU layers compute with the weights they claim (file: the packaged GGUF's own
Q4_1 and Q8_0 blocks; q4: float weights rounded to Q4_1), and each quantized engine agrees with the float32
engine on chat prompts closely enough (the agreement numbers are printed: ``pytest -s``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.layers.gguf_linear import GGUFEmbedding, GGUFLinear
from engine.layers.linear import Linear
from engine.layers import quantized_linear
from engine.layers.quantized_linear import (
    BFloat16Linear,
    Int8Linear,
    Q4Linear,
    cpu_linear,
    q4_1_from_float,
)
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.weights.gguf_blocks import GGUFBlocks
from engine.weights.gguf_file import GGUFFile
from engine.weights.gguf_names import hf_row_order
from engine.weights.gguf_weights import gguf_weights
from engine.worker.model_sources import default_gguf_file
from engine.sampling_params import SamplingParams
from kernels import cpu_native
from kernels.cpu_tiles import tiles
from kernels.quant_blocks import QuantBlocks
from tests.conftest import SMALL_KV_GIB
from tests.engine.test_engine_greedy import TEXTS
from tests.engine.test_models import tiny_hf_model

QUANTIZED = ("bfloat16", "int8", "q4", "file")
# bfloat16 keeps 8 significant bits: rounding to nearest moves a value by at most 2^-8 of its magnitude
BF16_ROUNDING = 2.0**-8
FP16_ROUNDING = 2.0**-11

QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Why is the sky blue?",
    "What is 7 times 8?",
    "Name three primary colours.",
    "Who wrote Romeo and Juliet?",
    "What does a bee make?",
    "How do plants get energy?",
    "What is the largest ocean on Earth?",
    "Give me a synonym for happy.",
    "What is the boiling point of water?",
    "How many days are in a leap year?",
    "What language is spoken in Brazil?",
    "Explain what a noun is.",
    "What is the opposite of cold?",
    "Suggest a name for a pet cat.",
]
NEW_TOKENS = 64
# measured on the 2-core dev VM (float32 engine as reference, 16 prompts x 64 tokens; int8 with the packed int8
# output layer; q4 with the Q4_1 x Q8 kernels and the Q8_0 output layer, kernels/cpu_quant_matmul.cpp):
#   bfloat16: first token 15/16, identical prefix 0.46, step-1 |logit diff| 0.064 (logits' spread: std 4.1)
#   int8:     first token 15/16, identical prefix 0.32, step-1 |logit diff| 0.32
#   q4:       first token 15/16, identical prefix 0.23, step-1 |logit diff| 0.19
#   (llama.cpp on the GGUF, benchmarks/cpu_agreement.py: first token 15/16, identical prefix 0.30; q4 through
#   torch's int4 kernel, bfloat16 activations, where the CPU lacks AVX-512 VNNI: 16/16, 0.57, 0.12)
# Floors leave room for other CPUs' kernels (a greedy prefix parts at the first near-tie); broken weights
# (wrong rows, nibbles or scales) give different first tokens and logits off by whole units.
# mode: (min first tokens equal, min mean identical-prefix share, max mean |logit diff| at step 1)
FLOORS = {
    "bfloat16": (14, 0.25, 0.15),
    "int8": (14, 0.15, 0.6),
    "q4": (14, 0.15, 0.3),
    "file": (14, 0.15, 0.3),
}


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def gguf_blocks(default_model_dir: Path) -> dict[str, QuantBlocks]:
    """The default model's GGUF blocks by Hugging Face name (query/key rows in Hugging Face's order)."""
    from types import SimpleNamespace
    import json

    config = SimpleNamespace(**json.loads((default_model_dir / "config.json").read_text()))
    found = dict(gguf_weights(GGUFFile(default_gguf_file()), config, None))
    return {name: b.unpack() for name, b in found.items() if isinstance(b, GGUFBlocks)}


@pytest.fixture(scope="module")
def engine() -> Callable[[str], LLM]:
    """One engine per cpu_weights mode for the whole module, built on first use."""
    built: dict[str, LLM] = {}

    def get(mode: str) -> LLM:
        if mode not in built:
            built[mode] = LLM(kv_cache_memory_gib=SMALL_KV_GIB, cpu_weights=mode)
        return built[mode]

    return get


@pytest.fixture(scope="module")
def chat_prompts(tokenizer) -> list[list[int]]:
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


@dataclass(slots=True)
class GreedyRun:
    tokens: list[list[int]]  # per prompt
    first_logits: torch.Tensor  # [prompts, vocab] the logits the first output token was chosen from


class FirstStepLogits:
    """Stands in for the engine's sampler: keeps the logits each sequence's first output token is sampled
    from (by prompt), and samples with the real sampler."""

    def __init__(self, sampler: Callable) -> None:
        self.sampler = sampler
        self.by_prompt: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, seqs: list, *args):
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens == 0:
                self.by_prompt.setdefault(tuple(seq.token_ids), logits[row].float().clone())
        return self.sampler(logits, seqs, *args)


@pytest.fixture(scope="module")
def greedy_run(engine, chat_prompts) -> Callable[[str], GreedyRun]:
    """Each mode's greedy tokens and step-1 logits on the chat prompts (all prompts in one batch)."""
    runs: dict[str, GreedyRun] = {}

    def get(mode: str) -> GreedyRun:
        if mode not in runs:
            runner = engine(mode).engine.runner
            recorder = runner.sampling.sampler = FirstStepLogits(runner.sampling.sampler)
            try:
                outputs = engine(mode).generate(
                    chat_prompts,
                    SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                )
            finally:
                runner.sampling.sampler = recorder.sampler
            logits = torch.stack([recorder.by_prompt[tuple(p)] for p in chat_prompts])
            runs[mode] = GreedyRun([o.token_ids for o in outputs], logits)
        return runs[mode]

    return get


def per_column(group_values: torch.Tensor) -> torch.Tensor:
    """[N, K / 32] per-group values -> [N, K]: each group's value under each of its 32 columns."""
    return group_values.float().repeat_interleave(32, dim=1)


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.float().bfloat16().float()


# ---------------------------------------------------------------- file: the GGUF's own blocks


def test_file_blocks_dequantize_as_the_gguf_package_does(gguf_blocks):
    """Every projection's blocks against gguf-py's own de-quantization of the file's tensor (its rows in llama.cpp's
    order: query and key rows put back in Hugging Face's order here); the embedding is the file's Q8_0."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    parts = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    heads = {"attn_q": 9, "attn_k": 3}  # SmolLM2-135M: 9 query heads, 3 KV heads
    layers = {0, 14, 29}
    checked = 0
    for tensor in GGUFReader(default_gguf_file()).tensors:
        layer, _, part = tensor.name.removeprefix("blk.").partition(".")
        part = part.removesuffix(".weight")
        if not tensor.name.startswith("blk.") or int(layer) not in layers or part not in parts:
            continue
        expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type))
        if part in heads:
            expected = expected[hf_row_order(expected.shape[0], heads[part])]
        blocks = gguf_blocks[f"model.layers.{layer}.{parts[part]}.weight"]
        assert blocks.format == "q4_1" and torch.equal(blocks.dequantize(), expected), tensor.name
        checked += 1
    assert checked == len(layers) * len(parts)
    assert gguf_blocks["model.embed_tokens.weight"].format == "q8_0"


def test_q4_linear_computes_with_the_blocks_and_bfloat16_scales(gguf_blocks):
    """Q4Linear applied to the identity gives its weight (transposed). torch's kernel de-quantizes
    ``(q - 8) * scale + zero`` with ``scale = d``, ``zero = m + 8 d`` held in bfloat16, and returns bfloat16."""
    blocks = gguf_blocks["model.layers.3.mlp.down_proj.weight"]  # [576, 1536]: the longest rows
    k = blocks.codes.shape[1]
    kernel = Q4Linear(blocks, None)(torch.eye(k)).t()  # (the identity is exact in bfloat16)
    d, m = per_column(blocks.d), per_column(blocks.m)
    zero = m + 8 * d
    expected = (blocks.codes.float() - 8) * bf16(d) + bf16(zero)
    # one bfloat16 rounding of the output (and fp32 rounding order inside the kernel: far below it)
    torch.testing.assert_close(kernel, bf16(expected), rtol=2 * BF16_ROUNDING, atol=1e-6)
    # Against GGUF's exact d * q + m: rounding d moves a weight by |q - 8| <= 8 times 2^-8 |d|, rounding the
    # zero by 2^-8 |zero|, and the bfloat16 output by 2^-8 of the weight; fp32 rounding adds ~2^-24 of each.
    bound = (
        8 * BF16_ROUNDING * d.abs()
        + BF16_ROUNDING * zero.abs()
        + BF16_ROUNDING * kernel.abs()
        + 1e-7
    )
    error = (kernel - blocks.dequantize()).abs()
    assert bool((error <= bound).all()), f"worst error / bound {(error / bound).max():.3f}"
    assert float((error / d.abs()).max()) < 0.1, (
        "bfloat16 scales must stay far within one 4-bit step"
    )


def test_file_engine_holds_the_gguf_blocks_in_every_projection(engine, gguf_blocks):
    """The file engine's fused projections are the GGUF blocks of their shards, in shard order (q, k, v and
    gate, up), as the native kernel's tiles; the logits head is the tied embedding's Q8_0 blocks; the embedding is
    looked up in the file."""
    model = engine("file").engine.model
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        expected = {
            layer.self_attn.qkv_proj: [f"{prefix}.self_attn.{p}_proj.weight" for p in "qkv"],
            layer.self_attn.o_proj: [f"{prefix}.self_attn.o_proj.weight"],
            layer.mlp.gate_up_proj: [f"{prefix}.mlp.{p}_proj.weight" for p in ("gate", "up")],
            layer.mlp.down_proj: [f"{prefix}.mlp.down_proj.weight"],
        }
        for module, names in expected.items():
            assert isinstance(module, GGUFLinear) and module.part_formats == ["q4_1"] * len(names)
            assert all(
                torch.equal(t, tiles(gguf_blocks[name])) for t, name in zip(module.tiles, names)
            )
    head = model.logits_head
    assert isinstance(head, GGUFLinear) and head.part_formats == ["q8_0"]
    assert torch.equal(head.tiles[0], tiles(gguf_blocks["model.embed_tokens.weight"]))
    assert isinstance(model.model.embed_tokens, GGUFEmbedding)
    ids = torch.tensor([0, 7, 49151, 7])
    assert torch.equal(
        model.model.embed_tokens(ids), gguf_blocks["model.embed_tokens.weight"].dequantize()[ids]
    )


# ---------------------------------------------------------------- the layers on random weights


def test_q4_from_float_rounds_each_weight_to_its_nearest_code():
    torch.manual_seed(0)
    weight = torch.randn(48, 256) * torch.logspace(-3, 0, 48)[:, None] + 0.01
    blocks = q4_1_from_float(weight)
    assert blocks.codes.dtype == torch.uint8 and int(blocks.codes.max()) <= 15
    groups = blocks.codes.view(48, 8, 32)
    # a group's minimum takes code 0 and its maximum code 15: the whole 4-bit range is used
    assert bool((groups.amin(-1) == 0).all()) and bool((groups.amax(-1) == 15).all())
    d, m = per_column(blocks.d), per_column(blocks.m)
    # half a step, plus fp16 rounding of d and m (2^-11 each) carried over at most 16 steps
    bound = d / 2 + FP16_ROUNDING * (m.abs() + 16 * d) + 1e-7
    error = (blocks.dequantize() - weight).abs()
    assert bool((error <= bound).all()), f"worst error / bound {(error / bound).max():.3f}"


def test_q4_from_float_keeps_a_constant_group_exact_and_rejects_ragged_rows():
    blocks = q4_1_from_float(torch.full((2, 32), 0.5))
    assert torch.equal(blocks.dequantize(), torch.full((2, 32), 0.5))
    with pytest.raises(ValueError, match="cpu_weights"):
        q4_1_from_float(torch.randn(2, 48))


def weight_error(mode: str, weight: torch.Tensor) -> torch.Tensor:
    """Largest change of each weight that the layer's storage may make (to its magnitude |w|)."""
    if mode == "bfloat16":
        return BF16_ROUNDING * weight.abs()
    # int8: half a step of the row's scale s = max|w| / 127, and s itself rounded to bfloat16 (times |q| <= 127)
    scale = weight.abs().amax(dim=1, keepdim=True) / 127
    return scale / 2 + BF16_ROUNDING * (weight.abs() + scale)


@pytest.mark.parametrize("mode", ["bfloat16", "int8"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_linear_layer_matches_float32_linear_within_its_rounding(mode: str, with_bias: bool):
    torch.manual_seed(1)
    # rows of very different magnitudes: a per-tensor (not per-row) int8 scale would fail the small rows
    weight = torch.randn(96, 256) * torch.logspace(-2, 0, 96)[:, None]
    bias = torch.randn(96) if with_bias else None
    x = torch.randn(2, 5, 256)
    layer = cpu_linear(mode, weight, bias)
    assert isinstance(layer, BFloat16Linear if mode == "bfloat16" else Int8Linear)
    out = layer(x)
    assert out.shape == (2, 5, 96) and out.dtype == torch.float32
    reference = F.linear(x, weight, bias)
    # input rounded to bfloat16 (2^-8 |x|), stored weights (weight_error), output rounded to bfloat16
    bound = (
        x.abs() @ weight_error(mode, weight).t()
        + BF16_ROUNDING * x.abs() @ weight.abs().t() * 1.01
        + BF16_ROUNDING * (out - (0 if bias is None else bias)).abs()
        + 1e-5
    )
    error = (out - reference).abs()
    assert bool((error <= bound).all()), f"worst error / bound {(error / bound).max():.3f}"


@pytest.mark.parametrize("onednn", [True, False], ids=["torch", "float32-slices"])
@pytest.mark.parametrize("rows", [1, 10])
def test_bfloat16_products_agree_on_either_path(monkeypatch: pytest.MonkeyPatch, onednn, rows):
    """torch's bfloat16 product (oneDNN's where the CPU has bfloat16 kernels) and the float32 one from slices of the
    weight (where it has none; the layer picks by the CPU, and both run on any CPU): the same exact products summed
    in float32, rounded to bfloat16; one row always takes torch's."""
    # (slices of 40, 40, 16 outputs)
    monkeypatch.setattr(quantized_linear, "_SLICE_BYTES", 4 * 256 * 40)
    torch.manual_seed(4)
    weight, x = torch.randn(96, 256), torch.randn(rows, 256).bfloat16()
    layer = BFloat16Linear(weight, None, onednn=onednn)
    out = layer.matmul(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    exact = x.double() @ layer.weight.double().t()
    assert bool(((out.double() - exact).abs() <= BF16_ROUNDING * exact.abs() + 1e-4).all())
    if onednn or rows == 1:
        assert torch.equal(out, F.linear(x, layer.weight))


@pytest.mark.parametrize("mode", QUANTIZED)
@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_quantized_layer_adds_its_bias_in_float32(mode: str, native: bool):
    torch.manual_seed(2)
    kernels = cpu_native.load(Path(EngineConfig().cache_dir) / "native") if native else None
    weight, bias, x = torch.randn(64, 128) * 0.05, torch.randn(64), torch.randn(3, 128)
    with_bias = cpu_linear(mode, weight, bias, native=kernels)
    without = cpu_linear(mode, weight, None, native=kernels)
    torch.testing.assert_close(with_bias(x) - without(x), bias.expand(3, 64), rtol=0, atol=1e-5)


# ---------------------------------------------------------------- engines: quality and choice


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("mode", ["float32", *QUANTIZED])
def test_recorded_step1_logits_are_the_ones_sampled_from(greedy_run, mode: str):
    run = greedy_run(mode)
    assert run.first_logits.argmax(dim=-1).tolist() == [tokens[0] for tokens in run.tokens]


@pytest.mark.parametrize("mode", QUANTIZED)
def test_quantized_engine_agrees_with_float32_engine(greedy_run, mode: str):
    """The acceptance numbers: over 16 chat prompts x 64 greedy tokens, how long each output stays identical
    to the float32 engine's, and how far its step-1 logits are from float32's."""
    reference, run = greedy_run("float32"), greedy_run(mode)
    first_equal = sum(a[0] == b[0] for a, b in zip(reference.tokens, run.tokens))
    shares = [first_divergence(a, b) / NEW_TOKENS for a, b in zip(reference.tokens, run.tokens)]
    prefix_share = sum(shares) / len(shares)
    logit_diff = float((run.first_logits - reference.first_logits).abs().mean())
    print(
        f"\ncpu_weights={mode}: first token equal {first_equal}/{len(shares)}, identical-prefix share "
        f"{prefix_share:.3f}, step-1 mean |logit diff| {logit_diff:.4f} "
        f"(float32 logits std {float(reference.first_logits.std()):.2f})"
    )
    min_first, min_share, max_diff = FLOORS[mode]
    assert first_equal >= min_first
    assert prefix_share >= min_share
    assert logit_diff <= max_diff


def test_auto_is_file_for_the_default_model(engine):
    llm = engine("file")
    assert llm.engine.config.cpu_weights == "file"
    modules = list(llm.engine.model.modules())
    assert (
        sum(isinstance(m, GGUFLinear) for m in modules)
        == 4 * len(llm.engine.model.model.layers) + 1
    )  # (and the output layer)
    assert not any(isinstance(m, Linear) for m in modules)
    assert EngineConfig(cpu_weights="auto").cpu_weights == "auto"  # (resolved at load, not before)


@pytest.mark.parametrize(
    "mode, resolved, layer",
    [("auto", "float32", Linear), ("q4", "q4", GGUFLinear), ("file", "float32", Linear)],
)
def test_model_without_gguf_blocks(tmp_path: Path, mode: str, resolved: str, layer: type):
    """A Hugging Face directory ships no blocks: auto (and file) keep float32; q4 quantizes its float weights
    (on the native kernel where one was built, else torch's int4 kernel)."""
    if layer is GGUFLinear and cpu_native.load(Path(EngineConfig().cache_dir) / "native") is None:
        layer = Q4Linear
    tiny_hf_model("llama").save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), num_kv_blocks=16, cpu_weights=mode)
    assert llm.engine.config.cpu_weights == resolved
    layers = llm.engine.model.model.layers
    assert all(
        isinstance(lay.self_attn.qkv_proj, layer) and isinstance(lay.mlp.down_proj, layer)
        for lay in layers
    )
    (out,) = llm.generate(
        [[5, 17, 200]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    assert len(out.token_ids) == 4


@pytest.mark.parametrize(
    "options",
    [
        {"cpu_weights": "q5"},
        {"cpu_weights": "q4", "dtype": "bfloat16", "device": "cpu"},
        {"cpu_weights": "int8", "dtype": "float16", "device": "cpu"},
    ],
)
def test_bad_cpu_weights_are_rejected_naming_the_field(options: dict):
    with pytest.raises(ValueError, match="cpu_weights"):
        EngineConfig(**options)


# ---------------------------------------------------------------- determinism of the native step


def test_file_greedy_tokens_do_not_depend_on_the_batch(tokenizer):
    """The engine's other tests compare batched runs with single ones: the native kernels must give each row the
    same result whatever rows it is computed with, and a prompt cut into chunks the same as one in a piece
    (prefix caching off: every prompt computed in full)."""
    llm = LLM(
        kv_cache_memory_gib=SMALL_KV_GIB,
        cpu_weights="file",
        enable_prefix_caching=False,
        max_num_batched_tokens=64,
    )
    prompts = [tokenizer.encode(t) for t in TEXTS]
    assert max(len(p) for p in prompts) > 64, (
        "a prompt longer than one step's budget: prefilled in chunks"
    )
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    single = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert batched == single


def test_file_greedy_output_under_memory_pressure_equals_each_request_alone(tokenizer):
    """Issue 22's reproduction: 48 KV blocks, preemption by recompute, 16 concurrent temperature-0 requests (4
    with n=4) against each sent alone. A preempted sequence's tokens are computed again as a prompt: the same
    numbers as when they were decoded, so every request and every one of an n=4 request's samples is the same."""
    llm = LLM(num_kv_blocks=48, preemption_mode="recompute", cpu_weights="file")
    prompts = [tokenizer.encode(f"{TEXTS[i % len(TEXTS)]} ({i})") for i in range(16)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, n=4 if i % 4 == 0 else 1)
        for i in range(16)
    ]
    loaded = iter(llm.generate(prompts, params))  # (a prompt's n samples one after another)
    assert llm.engine.scheduler.num_preemptions > 0, (
        "48 blocks of 16 tokens cannot hold all sixteen at once"
    )
    for prompt, param in zip(prompts, params):
        alone = llm.generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        )[0]
        samples = [next(loaded).token_ids for _ in range(param.n)]
        assert all(tokens == alone.token_ids for tokens in samples)


def test_file_greedy_tokens_do_not_depend_on_a_prefill_beside_them(tokenizer):
    """A request that arrives while another decodes makes mixed steps (its prefill beside the other's decode
    row): the decoding row must come out as in a decode-only step, whatever arrives when (the server's load)."""
    engine = LLMEngine(
        kv_cache_memory_gib=SMALL_KV_GIB, cpu_weights="file", enable_prefix_caching=False
    )
    first, other = (tokenizer.encode(t) for t in TEXTS[:2])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def first_tokens(other_after_steps: int | None) -> list[int]:
        engine.add_request("first", first, params)
        finals, steps = {}, 0
        while engine.has_unfinished_requests():
            if steps == other_after_steps:
                engine.add_request("other", other, params)
            finals.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
            steps += 1
        return finals["first"]

    alone = first_tokens(None)
    assert all(first_tokens(k) == alone for k in (1, 2, 5)), (
        "a prefill beside a decode changed its tokens"
    )
