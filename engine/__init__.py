"""pagoda's engine: paged KV cache, continuous batching, sampling. Names load on first use, so that
torch-free parts (sampling_params, validation, errors) import without torch."""
import importlib

_EXPORTS = {
    "LLM": "frontend.llm", "AsyncEngine": "frontend.async_engine", "EngineConfig": "config",
    "SamplingParams": "sampling_params", "PoolingParams": "pooling", "RequestOutput": "outputs", "TokenLogprob": "outputs",
    "EngineStats": "outputs", "ModelInfo": "outputs", "EngineRequest": "core.core_io", "RequestLimits": "validation",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"pagoda.engine.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'pagoda.engine' has no attribute {name!r}")


__all__ = list(_EXPORTS)
