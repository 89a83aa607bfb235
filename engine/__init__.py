"""pagoda's engine: paged KV cache, continuous batching, sampling."""
from engine.config import EngineConfig
from engine.llm import LLM
from engine.outputs import EngineStats, ModelInfo, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams


def __getattr__(name):
    if name == "AsyncEngine":  # keeps asyncio/threading out of plain offline imports
        from engine.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineConfig", "AsyncEngine", "RequestOutput", "TokenLogprob",
           "EngineStats", "ModelInfo"]
