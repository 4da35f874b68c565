"""The pagedchat serving engine (knows nothing of HTTP)."""

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams

__all__ = ["EngineConfig", "SamplingParams", "LLM", "LLMEngine", "AsyncEngine", "RequestOutput"]


def __getattr__(name: str):  # the heavy parts load on first use
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
