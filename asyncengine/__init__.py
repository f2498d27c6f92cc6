"""asyncengine: an asyncio-native, embeddable LLM inference engine.

Everything here is imported on first use: ``import asyncengine`` (and ``asyncengine --help``) must
not pay for torch."""
__all__ = ["LLM", "AsyncLLMEngine", "EngineConfig", "SamplingParams", "OutputKind", "RequestOutput",
           "CompletionOutput", "AsyncEngineError", "ConfigError", "EngineDeadError", "EngineOverloaded",
           "InvalidRequestError", "ModelLoadError", "RequestFailedError", "RequestLimits", "RequestLimitError",
           "AnyioEngine", "EngineCoreDied", "LoRARequest"]
__version__ = "0.1.0"

_WHERE = {
    "LLM": "asyncengine.engine.llm",
    "AsyncLLMEngine": "asyncengine.engine.async_engine",
    "AnyioEngine": "asyncengine.engine.anyio_bridge",
    "EngineConfig": "asyncengine.config",
    "SamplingParams": "asyncengine.sampling_params",
    "OutputKind": "asyncengine.sampling_params",
    "RequestOutput": "asyncengine.outputs",
    "CompletionOutput": "asyncengine.outputs",
    "RequestLimits": "asyncengine.config.request_limits",
    "LoRARequest": "asyncengine.lora_request",
    "RequestLimitError": "asyncengine.config.request_limits",
    **{name: "asyncengine.errors" for name in ("AsyncEngineError", "ConfigError", "EngineDeadError",
                                                 "EngineOverloaded", "InvalidRequestError", "ModelLoadError",
                                                 "RequestFailedError", "EngineCoreDied")},
}


def __getattr__(name):
    if name in _WHERE:
        import importlib

        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'asyncengine' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
