"""LangChain chat model over an in-process AsyncLLMEngine (no HTTP hop): ``pip install asyncengine[langchain]``.

    from asyncengine.integrations.langchain import ChatAsyncEngine
    llm = ChatAsyncEngine(model="smollm2-135m-instruct", max_tokens=128)   # the engine loads on first use
    llm.invoke("What is the capital of France?")
    async for chunk in llm.astream("Tell me a joke."): ...
    ChatAsyncEngine(engine=my_engine)   # an AsyncLLMEngine the app already runs (used on its own loop)

Sync and async calls both work from anywhere (``integrations/engine_thread.py`` runs the request on
the engine's loop). Leaving a stream early or cancelling the task aborts the engine request (its KV
blocks are freed); ``timeout`` aborts a request that runs too long. Tools (``bind_tools``) and
``with_structured_output`` go through the engine's structured outputs (``tool_calls.py``, shared
with the OpenAI server): a forced tool call or a JSON schema is guaranteed to parse. A vision model's
user messages may carry images: ``{"type": "image_url", "image_url": {"url": "data:..."}}`` or
LangChain's ``{"type": "image", "base64": ..., "mime_type": ...}`` blocks (chat_images.py). Engines built
here from a model name are shared by every chat model with the same model and ``engine_options``.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import Field, PrivateAttr, model_validator

from asyncengine.models.sampling_defaults import sampling_params_from
from asyncengine.errors import EngineOverloaded
from asyncengine.sampling_params import SAMPLING_KNOBS, OutputKind, SamplingParams

from .chat_images import chat_prompt, image_token
from .engine_thread import EngineBridge, bridge_of, close_shared_engines, shared_engine
from .langchain_messages import to_engine_messages
from .tool_calls import ToolPlan, response_format_params, with_tools_prompt

DEFAULT_MODEL = "smollm2-135m-instruct"
_KNOBS = SAMPLING_KNOBS  # None: unset, the engine fills it from the model's defaults

def _lc_tool_choice(tool_choice, tools: list[dict]):
    """LangChain's tool_choice spellings -> OpenAI's (what ToolPlan reads)."""
    if tool_choice in (None, "auto", "none", "required"):
        return tool_choice
    if tool_choice is True or tool_choice == "any":
        return "required"
    if isinstance(tool_choice, str):
        return {"type": "function", "function": {"name": tool_choice}}
    if isinstance(tool_choice, dict):
        return tool_choice
    raise ValueError(f"unsupported tool_choice {tool_choice!r}")


class ChatAsyncEngine(BaseChatModel):
    """A LangChain chat model served by an in-process :class:`AsyncLLMEngine`."""

    model: str = Field(default_factory=lambda: os.environ.get("ASYNCENGINE_MODEL", DEFAULT_MODEL),
                       alias="model_name")
    """Model name (``smollm2-135m-instruct``), HF folder or ``.gguf`` file (env ``ASYNCENGINE_MODEL``)."""
    engine: Any = Field(default=None, exclude=True)
    """An AsyncLLMEngine to use instead of building one from ``model``."""
    engine_options: dict[str, Any] = Field(default_factory=dict)
    """EngineConfig fields for the engine built from ``model`` (e.g. ``{"dtype": "float32"}``)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None
    """None: until the model ends its answer or the context is full."""
    min_tokens: int | None = None
    stop: list[str] | None = None
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    timeout: float | None = None
    """Seconds a call may take; past it the request is aborted and TimeoutError raised."""
    max_retries: int = 2
    """Retries (with backoff) when the engine's waiting queue is full (EngineOverloaded)."""
    streaming: bool = False
    """``invoke`` streams internally (callbacks see each token)."""
    lora_request: Any = None
    """A LoRARequest, or an adapter's name (``engine.add_lora``); a call's ``lora_request=`` overrides it."""

    _bridge: EngineBridge | None = PrivateAttr(default=None)

    model_config = {"populate_by_name": True}

    @model_validator(mode="before")
    @classmethod
    def _stop_list(cls, values: Any) -> Any:
        if isinstance(values, dict) and isinstance(values.get("stop"), str):
            values = {**values, "stop": [values["stop"]]}
        # a given engine names the model unless the caller did
        if isinstance(values, dict) and values.get("engine") is not None and not (
                values.get("model") or values.get("model_name")):
            values = {**values, "model": str(values["engine"].config.model)}
        return values

    # ------------------------------------------------------------ LangChain's identity

    @property
    def _llm_type(self) -> str:
        return "asyncengine"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, **{k: getattr(self, k) for k in (*_KNOBS, "max_tokens", "stop", "seed")
                                        if getattr(self, k) is not None}}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any):
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "asyncengine"
        params["ls_model_name"] = kwargs.get("model") if isinstance(kwargs.get("model"), str) else self.model
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        if not params.get("ls_stop") and (stop or self.stop):
            params["ls_stop"] = list(stop or self.stop)
        return params

    # ------------------------------------------------------------ engine

    @property
    def bridge(self) -> EngineBridge:
        return bridge_of(self, self.model)

    def _model_for(self, kwargs: dict) -> tuple[str, EngineBridge]:
        """A per-call ``model=`` (LangChain's model override) runs on that model's shared engine."""
        other = kwargs.get("model")
        if isinstance(other, str) and other != self.model:
            return other, EngineBridge(shared_engine(other, self.engine_options))
        return self.model, self.bridge

    def _sampling_params(self, stop: list[str] | None, kwargs: dict, structured, bridge) -> SamplingParams:
        def pick(name):
            return kwargs[name] if kwargs.get(name) is not None else getattr(self, name)

        stop = stop if stop is not None else pick("stop")
        # the knobs left None stay unset: the engine fills them from the model's defaults
        return sampling_params_from(
            **{k: pick(k) for k in _KNOBS}, max_tokens=pick("max_tokens"), min_tokens=pick("min_tokens") or 0,
            stop=list(stop) if stop else None, seed=pick("seed"), logit_bias=pick("logit_bias"),
            structured_outputs=structured, output_kind=OutputKind.DELTA)

    def _prepare(self, messages: list[BaseMessage], stop, kwargs):
        """(engine prompt: the messages, or with images token ids + images; SamplingParams, ToolPlan,
        model name, bridge) of one call."""
        tools = kwargs.get("tools")
        plan = ToolPlan(tools, _lc_tool_choice(kwargs.get("tool_choice"), tools or []),
                        kwargs.get("parallel_tool_calls"))
        from_format = response_format_params(kwargs.get("response_format"))
        from_tools = plan.structured()
        if from_tools is not None and from_format is not None:
            raise ValueError("give response_format or a tool_choice that forces a tool call, not both")
        name, bridge = self._model_for(kwargs)
        images: list = []
        msgs = with_tools_prompt(to_engine_messages(messages, images, image_token(bridge.engine)), plan.prompt())
        prompt = chat_prompt(bridge.engine, msgs, images)  # with images: rendered here, ids + images
        return prompt, self._sampling_params(stop, kwargs, from_tools or from_format, bridge), plan, name, bridge

    def _deadline(self, kwargs) -> float | None:
        t = kwargs.get("timeout", self.timeout)
        return time.monotonic() + t if t else None

    # ------------------------------------------------------------ the four entry points

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        msgs, params, plan, name, bridge = self._prepare(messages, stop, kwargs)
        deadline = self._deadline(kwargs)
        attempt = 0
        while True:
            try:
                lora = kwargs.get("lora_request") or self.lora_request
                outs = bridge.stream(msgs, params, deadline=deadline, lora_request=lora)
                yield from self._emit(outs, plan, name, run_manager)
                return
            except EngineOverloaded:
                if attempt >= self.max_retries:
                    raise
                time.sleep(0.5 * 2 ** attempt)
                attempt += 1

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        msgs, params, plan, name, bridge = self._prepare(messages, stop, kwargs)
        deadline = self._deadline(kwargs)
        attempt = 0
        while True:
            try:
                lora = kwargs.get("lora_request") or self.lora_request
                outs = bridge.astream(msgs, params, deadline=deadline, lora_request=lora)
                try:
                    async for chunk in self._aemit(outs, plan, name, run_manager):
                        yield chunk
                finally:
                    await outs.aclose()
                return
            except EngineOverloaded:
                if attempt >= self.max_retries:
                    raise
                await asyncio.sleep(0.5 * 2 ** attempt)
                attempt += 1

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return _result(list(self._stream(messages, stop, run_manager if self.streaming else None, **kwargs)))

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        chunks = [c async for c in self._astream(messages, stop, run_manager if self.streaming else None, **kwargs)]
        return _result(chunks)

    # the stream of chunks, shared by sync and async: text deltas (or held back), then the last one

    def _emit(self, outs, plan: ToolPlan, name: str, run_manager) -> Iterator[ChatGenerationChunk]:
        state = _EmitState(plan)
        last = None
        try:
            for out in outs:
                last = out
                for chunk in state.feed(out):
                    if run_manager:
                        run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
        finally:
            outs.close()
        yield self._last_chunk(state, last, name)

    async def _aemit(self, outs, plan: ToolPlan, name: str, run_manager) -> AsyncIterator[ChatGenerationChunk]:
        state = _EmitState(plan)
        last = None
        async for out in outs:
            last = out
            for chunk in state.feed(out):
                if run_manager:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        yield self._last_chunk(state, last, name)

    def _last_chunk(self, state: "_EmitState", out, name: str) -> ChatGenerationChunk:
        if out is None or not out.finished:
            raise RuntimeError("the engine stream ended without a final output")
        c = out.outputs[0]
        # the servers' parser of the JSON-array format (chat_parsers), read once the answer is whole
        parser = state.plan.output_parser()
        parser.feed(state.text)
        calls = parser.result().tool_calls
        n_in, n_out = len(out.prompt_token_ids or []), state.num_tokens
        usage = UsageMetadata(input_tokens=n_in, output_tokens=n_out, total_tokens=n_in + n_out)
        finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        meta = {"model_name": name, "model_provider": "asyncengine", "finish_reason": finish}
        if c.stop_reason is not None:
            meta["stop_reason"] = c.stop_reason
        content = "" if calls else "".join(state.held)
        tool_call_chunks = [{"name": k.name, "args": k.arguments, "id": k.id, "index": i, "type": "tool_call_chunk"}
                            for i, k in enumerate(calls)]
        msg = AIMessageChunk(content=content, tool_call_chunks=tool_call_chunks, usage_metadata=usage,
                             response_metadata=meta, chunk_position="last")
        return ChatGenerationChunk(message=msg, generation_info={"finish_reason": finish})

    # ------------------------------------------------------------ tools and structured output

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: str | dict | bool | None = None,
                   parallel_tool_calls: bool | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Tools in any LangChain form (BaseTool, function, pydantic model, JSON schema, OpenAI dict).
        ``tool_choice``: "auto" (default), "none", "any"/"required"/True (some call, forced by the
        grammar), or a tool's name (that tool, forced)."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        oa_choice = _lc_tool_choice(tool_choice, formatted)
        ToolPlan(formatted, oa_choice, parallel_tool_calls)  # a bad tool or choice fails here, not at the call
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return self.bind(tools=formatted, **kwargs)

    def with_structured_output(self, schema: dict | type, *, include_raw: bool = False,
                               method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
                               strict: bool | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, dict | Any]:
        """The answer parsed into ``schema``. ``json_schema`` (default): the output is constrained
        to the schema; ``function_calling``: a forced call of a tool with that schema;
        ``json_mode``: a JSON object, which the prompt should describe. Elsewhere JSON mode only
        promises valid JSON, and an object missing a key fails the parse into ``schema``; here the
        grammar can promise that schema too, so json_mode constrains to it as json_schema does."""
        if kwargs:
            raise ValueError(f"unsupported arguments {sorted(kwargs)}")
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw)
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        if method in ("json_schema", "json_mode"):
            fmt = {"type": "json_schema", "json_schema": {"name": "output", "schema": convert_to_json_schema(schema)}}
        else:
            raise ValueError(f"method must be json_schema, function_calling or json_mode, not {method!r}")
        llm = self.bind(response_format=fmt, ls_structured_output_format={
            "kwargs": {"method": method, "strict": strict}, "schema": convert_to_json_schema(schema)})
        parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
        if include_raw:
            parsed = RunnablePassthrough.assign(parsed=lambda x: parser.invoke(x["raw"]), parsing_error=lambda _: None)
            fallback = RunnablePassthrough.assign(parsed=lambda _: None)
            return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")
        return llm | parser


class _EmitState:
    """What one answer has streamed so far: its text, and what is held back while it may be a call."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parts: list[str] = []
        self.held: list[str] = []
        self.num_tokens = 0
        # forced calls are never text; "auto" answers wait until their first visible character
        self.mode = "hold" if plan.forced else ("undecided" if plan.mode == "auto" else "text")

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def feed(self, out) -> list[ChatGenerationChunk]:
        c = out.outputs[0] if out.outputs else None
        delta = c.text if c is not None else ""
        self.num_tokens += len(c.token_ids) if c is not None else 0
        if not delta:
            return []
        self.parts.append(delta)
        if self.mode == "undecided":
            head = self.text.lstrip()
            if not head:
                self.held.append(delta)
                return []
            self.mode = "hold" if head[0] in "[{" else "text"
            if self.mode == "text":
                delta, self.held = "".join(self.held) + delta, []
        if self.mode == "hold":
            self.held.append(delta)
            return []
        return [ChatGenerationChunk(message=AIMessageChunk(content=delta))]


def _result(chunks: list[ChatGenerationChunk]) -> ChatResult:
    """The whole answer from its chunks (tool calls parsed, usage and metadata from the last)."""
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    m = total.message
    msg = AIMessage(content=m.content, tool_calls=m.tool_calls, invalid_tool_calls=m.invalid_tool_calls,
                    usage_metadata=m.usage_metadata, response_metadata=m.response_metadata, id=m.id)
    return ChatResult(generations=[ChatGeneration(message=msg, generation_info=total.generation_info)])


__all__ = ["ChatAsyncEngine", "shared_engine", "close_shared_engines", "to_engine_messages"]
