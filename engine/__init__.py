"""The pagedchat serving engine (knows nothing of HTTP)."""

import os

# OpenMP threads (torch's and the native CPU kernels') sleep at a barrier instead of spinning, unless the user set
# a policy: libgomp reads it once, when torch loads it, so it is set before the first torch import (the engine core
# process inherits it). On a small CPU shared with anything else a spinning thread holds the core its sibling
# needs, and every parallel loop of a step then waits for the scheduler: the default model's decode step took
# ~940 ms on 2 threads beside a busy test run, ~8 ms sleeping (issue 49; docs/benchmarks/cpu.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncEngine", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]


# the heavy parts (torch) load on first use: a grammar worker imports none
def __getattr__(name: str):
    if name == "EngineConfig":
        from engine.config import EngineConfig

        return EngineConfig
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "RequestOutput":
        from engine.output.outputs import RequestOutput

        return RequestOutput
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
