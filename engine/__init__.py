"""The pagedchat serving engine (knows nothing of HTTP)."""
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams

__all__ = ["EngineConfig", "SamplingParams", "LLM", "LLMEngine", "AsyncEngine", "RequestOutput"]


def __getattr__(name: str):  # the heavy parts load on first use
    if name in ("LLM", "LLMEngine", "RequestOutput"):
        from engine import llm_engine
        return getattr(llm_engine, name)
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)
