"""asyncengine: an asyncio-native, embeddable LLM inference engine."""
from asyncengine.config import EngineConfig
from asyncengine.engine.validation import RequestLimitError, RequestLimits
from asyncengine.errors import (AsyncEngineError, ConfigError, EngineDeadError, EngineOverloaded,
                                InvalidRequestError, ModelLoadError, RequestFailedError)
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.sampling_params import OutputKind, SamplingParams

__all__ = ["LLM", "AsyncLLMEngine", "EngineConfig", "SamplingParams", "OutputKind", "RequestOutput",
           "CompletionOutput", "AsyncEngineError", "ConfigError", "EngineDeadError", "EngineOverloaded",
           "InvalidRequestError", "ModelLoadError", "RequestFailedError", "RequestLimits", "RequestLimitError"]
__version__ = "0.1.0"


def __getattr__(name):  # the engines pull in torch and the model code: import them on first use
    if name == "LLM":
        from asyncengine.engine.llm import LLM
        return LLM
    if name == "AsyncLLMEngine":
        from asyncengine.engine.async_engine import AsyncLLMEngine
        return AsyncLLMEngine
    raise AttributeError(name)
