"""engine/models/llama_persistent.py: the persistent decode pass as LlamaModel takes it.

On the CPU the kernel dispatch runs ``reference.persistent_decode`` (the layer path op by op), so these check the
wiring: the model's tensors, the pass's metadata, rotary caches and scale reach the kernel in order, the final
norm follows, and the pass is taken only where it should be. The kernel itself: tests/kernels/
test_persistent_decode.py (interpreter) and tests/gpu/test_persistent_decode_gpu.py (the engine on an H100).
"""

from __future__ import annotations

import pytest
import torch

from engine.kv_backend.paged import PagedKV
from engine.models import llama_persistent
from engine.models.llama import LlamaModel
from engine.models.llama_args import LlamaArgs
from engine.models.llama_persistent import (
    MAX_ROWS,
    LlamaPersistentDecoder,
    persistent_decoder,
    switched_on,
)
from engine.forward_context import AttentionMetadata, forward_context
from kernels.decoder_stack import DecoderStack, LayerTensors

ARGS = LlamaArgs(
    vocab_size=97,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-5,
    max_position=256,
    rope={"rope_theta": 10000.0},
    qkv_bias=False,
    o_bias=False,
    mlp_bias=False,
    qk_norm=False,
    tie_word_embeddings=False,
)
BLOCK_SIZE, NUM_BLOCKS = 16, 12


def make_model() -> tuple[LlamaModel, PagedKV]:
    torch.manual_seed(0)
    model = LlamaModel(ARGS)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * 0.1)
    kv = PagedKV(ARGS.num_layers, ARGS.num_kv_heads, ARGS.head_dim, torch.float32, torch.device("cpu"),
                 BLOCK_SIZE)  # fmt: skip
    kv.allocate(NUM_BLOCKS)
    kv.k_caches.normal_()
    kv.v_caches.normal_()
    for i, layer in enumerate(model.layers):
        layer.self_attn.attn.bind(kv, i)
    return model, kv


def stack_of(model: LlamaModel) -> DecoderStack:
    layers = [
        LayerTensors(
            qkv=layer.self_attn.qkv_proj.weight,
            o=layer.self_attn.o_proj.weight,
            gate_up=layer.mlp.gate_up_proj.weight,
            down=layer.mlp.down_proj.weight,
            norm_in=layer.input_layernorm.weight,
            norm_post=layer.post_attention_layernorm.weight,
            k_cache=layer.self_attn.attn.k_cache,
            v_cache=layer.self_attn.attn.v_cache,
        )
        for layer in model.layers
    ]
    return DecoderStack(layers, ARGS.num_heads, ARGS.num_kv_heads, ARGS.head_dim, ARGS.rms_norm_eps)


def decode_metadata(contexts: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
    """Sequence i owns blocks 3i .. 3i + 2; its new token sits at position ``contexts[i] - 1``."""
    tables = torch.tensor(
        [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(len(contexts))], dtype=torch.int32
    )
    positions = torch.tensor([c - 1 for c in contexts], dtype=torch.int64)
    slots = torch.stack([tables[i, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                         for i, p in enumerate(positions.tolist())]).to(torch.int64)  # fmt: skip
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables,
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        num_decodes=len(contexts),
        prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
    )
    return meta, positions


@pytest.mark.parametrize("contexts", [[5], [20, 33]])
def test_the_pass_gives_what_the_layers_give(contexts: list[int]) -> None:
    model, kv = make_model()
    caches = kv.k_caches.clone(), kv.v_caches.clone()
    meta, positions = decode_metadata(contexts)
    ids = torch.tensor([7, 42][: len(contexts)])
    with torch.no_grad(), forward_context(meta):
        want = model(ids, positions)
    written = kv.k_caches.clone(), kv.v_caches.clone()
    kv.k_caches.copy_(caches[0])
    kv.v_caches.copy_(caches[1])
    model.persistent = LlamaPersistentDecoder(model.layers, stack_of(model), None)
    calls = []
    with torch.no_grad(), forward_context(meta):
        original = model.persistent.forward
        model.persistent.forward = lambda *a: calls.append(1) or original(*a)
        got = model(ids, positions)
    assert calls == [1]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(kv.k_caches, written[0], atol=1e-6)
    assert torch.allclose(kv.v_caches, written[1], atol=1e-6)
    # and the check can fail: without the final norm the output is another
    assert not torch.allclose(got, model.embed_tokens(ids), atol=1e-2)


def test_passes_it_does_not_take() -> None:
    model, _ = make_model()
    decoder = LlamaPersistentDecoder(model.layers, stack_of(model), None)
    meta, _ = decode_metadata([5] * (MAX_ROWS + 1))
    assert decoder.takes(MAX_ROWS, decode_metadata([5] * MAX_ROWS)[0])
    assert not decoder.takes(MAX_ROWS + 1, meta)  # more rows than measured faster
    prefill, _ = decode_metadata([5])
    prefill.num_decodes = 0
    assert not decoder.takes(1, prefill)  # a prompt chunk
    assert not decoder.takes(1, None)


def test_the_cpu_binds_no_pass_and_the_switch_is_checked(monkeypatch) -> None:
    model, _ = make_model()
    assert persistent_decoder(model.layers, ARGS, 1) is None  # CPU tensors
    monkeypatch.setenv("PAGEDCHAT_PERSISTENT_DECODE", "off")
    assert not switched_on()
    monkeypatch.setenv("PAGEDCHAT_PERSISTENT_DECODE", "on")
    with pytest.raises(ValueError, match="PAGEDCHAT_PERSISTENT_DECODE"):
        switched_on()
    monkeypatch.setenv("PAGEDCHAT_PERSISTENT_DECODE", "auto")
    assert switched_on()
    assert llama_persistent.MAX_ROWS >= 1
