"""The HTTP server on CUDA: `pagedchat serve` with dummy llama-3.2-1b weights (no tokenizer) answers token-id
completions, streamed one event per token, with the same greedy tokens as the offline engine on the same
weights; 16 concurrent streams with 6 closed midway leave no KV block held. The same with two front processes
over the one core (``--api-server-count 2``, sessions in Redis)."""

from __future__ import annotations

import contextlib
import json
import random
import threading

import httpx
import pytest
import torch

from tests.redis_harness import running_redis
from tests.server_harness import running_server, wait_until_idle

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"
)

DUMMY = (
    "--load-format",
    "dummy",
    "--model-config",
    "llama-3.2-1b",
    "--dtype",
    "float32",
    "--device",
    "cuda",
    "--num-kv-blocks",
    "512",
    "--max-model-len",
    "2048",
    "--gpu-memory-utilization",
    "0.5",
)


def stream_tokens(
    base_url: str, prompt: list[int], max_tokens: int, stop_after: int | None = None
) -> list[str]:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,
    }
    tokens = []
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                tokens += (
                    chunk["choices"][0]["logprobs"]["tokens"]
                    if chunk["choices"][0]["logprobs"]
                    else []
                )
                if stop_after is not None and len(tokens) >= stop_after:
                    break
    return tokens


@pytest.mark.parametrize("fronts", [1, 2])
def test_server_on_cuda_streams_the_offline_engines_greedy_tokens(fronts: int):
    from engine import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(10000) for _ in range(n)] for n in (5, 40, 300)]
    with contextlib.ExitStack() as stack:
        extra = ()
        if fronts > 1:
            redis = stack.enter_context(running_redis())
            extra = ("--api-server-count", str(fronts), "--redis-url", redis.url)
        server = stack.enter_context(running_server(*DUMMY, *extra))
        served = [stream_tokens(server.base_url, p, 12) for p in prompts]
        results: dict[int, list[str]] = {}
        threads = [
            threading.Thread(
                target=lambda i=i: results.__setitem__(
                    i,
                    stream_tokens(
                        server.base_url,
                        prompts[i % 3] + [i],
                        64,
                        stop_after=4 if i % 3 == 0 else None,
                    ),
                )
            )
            for i in range(16)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        # i = 0, 3, ..., 15 stopped early
        assert sum(len(tokens) == 64 for tokens in results.values()) == 16 - 6
        wait_until_idle(server)
    llm = LLM(
        load_format="dummy",
        model_config="llama-3.2-1b",
        dtype="float32",
        device="cuda",
        num_kv_blocks=512,
        max_model_len=2048,
        gpu_memory_utilization=0.5,
    )
    offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert served == [[f"token_id:{t}" for t in out.token_ids] for out in offline]
