"""pagoda: LLM text generation over gRPC. pagoda.engine (offline LLM, AsyncEngine), pagoda.server,
pagoda.client, and pagoda.v1 (the generated stubs of the contract, see protos/generate.py)."""


def __getattr__(name):
    if name in ("LLM", "SamplingParams", "AsyncEngine", "EngineConfig"):
        import pagoda.engine
        return getattr(pagoda.engine, name)
    if name == "__version__":
        from importlib.metadata import version
        return version("pagoda")
    raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
