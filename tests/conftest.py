"""Shared fixtures: the default model (converted once into the cache dir) and its transformers twin."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# OpenMP threads waiting at a barrier sleep instead of spinning (libgomp reads this as torch loads it): on a small
# shared CPU a spinning thread holds the core its sibling needs, and each of a step's parallel loops then waits for
# the scheduler (a 16-token greedy run on 2 threads took 2-32 s instead of 0.35 s beside one busy process). The
# servers the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The suite's servers share one cache dir, so the disk tier of the prefix cache is off unless a test turns it on (the
# tier's own tests give their own --kv-disk-path in a tmp dir); the CLI reads this variable (app/cli.py).
os.environ.setdefault("PAGEDCHAT_KV_DISK_SIZE", "0")

import pytest
import pytest_asyncio
import torch

if not torch.cuda.is_available():
    # any Triton kernel imported in a CPU test session runs in the interpreter (must precede triton's import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.config import EngineConfig
from engine.worker.model_sources import default_gguf_file, ensure_default_model

# Small KV pools keep engine start-up cheap in tests; each test states the sizes it depends on.
SMALL_KV_GIB = 0.1

# The modules whose outcome depends on the CPU's numerics (greedy agreement with transformers or between weight
# formats, the native kernels at each level) or its speed (the soak's TPOT). They are marked ``isa``: `make test`
# runs them once more with torch, oneDNN, MKL and our kernels held to AVX2, as on an AVX2-only x86 CPU (where the
# CPU has nothing above AVX2, the whole suite's run already was that run: the Makefile does not repeat it).
ISA_SENSITIVE = frozenset(
    {
        "tests/engine/test_cpu_weights.py",
        "tests/engine/test_engine_greedy.py",
        "tests/engine/test_models.py",
        "tests/kernels/test_cpu_attention.py",
        "tests/kernels/test_cpu_native.py",
        "tests/kernels/test_gguf_kernels.py",
        "tests/server/test_soak.py",
        "tests/test_greedy_agreement.py",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.relative_to(config.rootpath).as_posix() in ISA_SENSITIVE:
            item.add_marker(pytest.mark.isa)
    if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2":
        # held to AVX2 (make test's second run): a greedy run with its sampled ids read one step late computes
        # the very numbers of the run that reads them at once; the order of the late reads does not depend on the
        # CPU, and the first run checks it. Only the numerics are run again.
        late = [item for item in items if _reads_late(item)]
        if late:
            config.hook.pytest_deselected(items=late)
            items[:] = [item for item in items if not _reads_late(item)]


def _reads_late(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("async_scheduling") is True


@pytest.fixture(scope="module")
def redis_server():
    """A real redis-server for one test module (tests/redis_harness.py); the modules that use it share this."""
    from tests.redis_harness import running_redis

    with running_redis() as server:
        yield server


@pytest.fixture
async def engine():
    """An AsyncEngine on the default model (the core in its own process), stopped afterwards."""
    from engine.async_engine import AsyncEngine

    engine = AsyncEngine(kv_cache_memory_gib=SMALL_KV_GIB, max_num_batched_tokens=256)
    await engine.start()
    yield engine
    await engine.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_engine():
    """``engine`` once for a module's tests that leave it as they found it (no fault, kill or stop; nothing
    running at their end): one core process and one model load for them all. Their coroutines run in the
    module's event loop, where the engine's own tasks live: ``@pytest.mark.asyncio(loop_scope="module")``."""
    from engine.async_engine import AsyncEngine

    engine = AsyncEngine(kv_cache_memory_gib=SMALL_KV_GIB, max_num_batched_tokens=256)
    await engine.start()
    yield engine
    await engine.stop()


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model's directory: its config and tokenizer, described from its GGUF file."""
    return ensure_default_model(Path(EngineConfig().cache_dir))


@pytest.fixture(scope="session")
def hf_model_dir() -> Path:
    """The default model as a Hugging Face directory in float32 (tests/hf_export.py), for transformers."""
    from tests.hf_export import hf_directory

    return hf_directory(default_gguf_file(), Path(EngineConfig().cache_dir))


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def hf_model(hf_model_dir: Path):
    """transformers' own implementation of the same weights: the oracle for greedy outputs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_model_dir, dtype=torch.float32)
    return model.eval()


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Exactly ``max_new_tokens`` greedy tokens from transformers' model with its own KV cache: argmax at
    every step, EOS neither stopping nor masked (generate's min_new_tokens would mask it)."""
    device = hf_model.device
    tokens, past, step_input = [], None, torch.tensor([prompt_ids], device=device)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            out = hf_model(input_ids=step_input, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
            step_input = torch.tensor([[tokens[-1]]], device=device)
    return tokens


@pytest.fixture(autouse=True, scope="session")
def _quiet_threads() -> None:
    """One torch thread per test process by default: `make test` runs two workers on a 2-core machine, and two
    threads each oversubscribed the cores (the engine tests ran 7.6% slower; the servers the tests start already run
    one, tests/server_harness.py). The native kernels' own tests use two (tests/kernels/test_cpu_native.py), so
    their parallel tasks run as a server's do."""
    torch.set_num_threads(int(os.environ.get("PAGEDCHAT_TEST_THREADS", "1")))


@pytest.fixture(autouse=True, scope="session")
def _one_tokenizer_per_model_directory() -> Iterator[None]:
    """The engines a test process builds (~200 in the suite) share one tokenizer per model directory, as a server's
    threads share one (read-only once loaded: engine/worker/tokenizer_files.py's ``fix_settings``): a load is ~0.25 s
    of an engine's ~0.8 s build on 2 vCPUs. Keyed by the tokenizer files' sizes and times, so a directory a test
    rewrites loads again. Only the engine loader's call is shared; the tokenizer loader's own tests call it
    directly, and a test that changes a tokenizer works on a copy."""
    from engine.worker import loader

    load = loader.load_tokenizer
    loaded: dict[tuple, Any] = {}

    def shared(path: Path | str | None) -> Any | None:
        if path is None:
            return None
        key = (Path(path).resolve(), *_file_stamps(Path(path)))
        if key not in loaded:
            loaded[key] = load(path)
        return loaded[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader, "load_tokenizer", shared)
        yield


def _file_stamps(path: Path) -> tuple:
    names = (
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "chat_template.json",
    )
    stats = [(path / name).stat() if (path / name).is_file() else None for name in names]
    return tuple((s.st_size, s.st_mtime_ns) if s is not None else None for s in stats)


@pytest.fixture
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``torch.empty`` during a test is NaN-filled: legal (empty promises nothing), and a kernel that
    leaves an output element unwritten fails. Kernel tests opt in with ``usefixtures``."""
    empty = torch.empty

    def nan_empty(*args, **kwargs) -> torch.Tensor:
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", nan_empty)
