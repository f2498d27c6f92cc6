"""LlamaIndex LLM over an in-process AsyncLLMEngine (no HTTP hop): ``pip install asyncengine[llamaindex]``.

    from asyncengine.integrations.llamaindex import AsyncEngineLLM
    llm = AsyncEngineLLM(model="smollm2-135m-instruct", max_tokens=128)
    llm.chat([ChatMessage(role="user", content="Hi")]);  await llm.astream_chat(...)

``chat`` / ``stream_chat`` render the model's chat template (a vision model's messages may carry
``ImageBlock``s: bytes, a path or a data: URL, integrations/chat_images.py); ``complete`` /
``stream_complete`` continue raw text. Sync and async calls work from anywhere, and leaving a stream early aborts the
engine request, as with the LangChain model (both run on ``engine_thread.EngineBridge`` and share
engines built from a model name).
"""
from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.types import (ChatMessage, ChatResponse, ChatResponseAsyncGen, ChatResponseGen,
                                              CompletionResponse, CompletionResponseAsyncGen, CompletionResponseGen,
                                              ImageBlock, LLMMetadata, MessageRole, TextBlock)
from llama_index.core.llms import LLM
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from pydantic import Field, PrivateAttr

from asyncengine.models.sampling_defaults import sampling_params_from
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import SAMPLING_KNOBS, OutputKind, SamplingParams

from .chat_images import chat_prompt, image_from_url, image_token
from .engine_thread import EngineBridge, bridge_of

_ROLES = {MessageRole.SYSTEM: "system", MessageRole.DEVELOPER: "system", MessageRole.USER: "user",
          MessageRole.ASSISTANT: "assistant", MessageRole.CHATBOT: "assistant", MessageRole.MODEL: "assistant",
          MessageRole.TOOL: "tool", MessageRole.FUNCTION: "tool"}


def _image(block: ImageBlock):
    """An ImageBlock as what the engine decodes: its bytes (given, or the file its path names), or
    its data: URL; other URLs are not fetched (integrations/chat_images.py)."""
    if block.image is not None or block.path is not None:
        return block.resolve_image().read()
    return image_from_url(str(block.url) if block.url is not None else None)


def _messages(messages: Sequence[ChatMessage], images: list | None = None,
              image_token: str | None = None) -> list[dict]:
    """LlamaIndex messages -> the engine's chat messages: the text blocks, and each ImageBlock as
    ``image_token`` (a model that takes images; else refused) with its data appended to ``images``."""
    out = []
    for m in messages:
        role = _ROLES.get(m.role)
        if role is None:
            raise ValueError(f"unsupported message role {m.role!r}")
        if not any(isinstance(b, ImageBlock) for b in m.blocks):
            out.append({"role": role, "content": m.content or ""})
            continue
        if image_token is None:
            raise ValueError("this model takes no images (an ImageBlock in a message)")
        parts = []
        for b in m.blocks:
            if isinstance(b, TextBlock):
                parts.append(b.text)
            elif isinstance(b, ImageBlock):
                images.append(_image(b))
                parts.append(image_token)
        out.append({"role": role, "content": "\n".join(parts)})
    return out


class AsyncEngineLLM(LLM):
    """A LlamaIndex LLM served by an in-process :class:`AsyncLLMEngine`."""

    model: str = Field(default_factory=lambda: os.environ.get("ASYNCENGINE_MODEL", "smollm2-135m-instruct"),
                       description="model name, HF folder or .gguf file")
    engine: Any = Field(default=None, exclude=True, description="an AsyncLLMEngine to use instead")
    engine_options: dict[str, Any] = Field(default_factory=dict, description="EngineConfig fields")
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = Field(default=None, description="None: until the model ends its answer")
    stop: list[str] | None = None
    seed: int | None = None
    timeout: float | None = Field(default=None, description="seconds; past it the request is aborted")
    lora_request: Any = Field(default=None, exclude=True, description="a LoRARequest, or the name of an "
                              "adapter added to the engine (engine.add_lora); a call's lora_request= overrides it")

    _bridge: EngineBridge | None = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "AsyncEngineLLM"

    @property
    def bridge(self) -> EngineBridge:
        return bridge_of(self, self.model)

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self.bridge.engine.max_model_len, num_output=self.max_tokens or -1,
                           is_chat_model=True, model_name=self.model)

    def _params(self, kwargs: dict) -> SamplingParams:
        def pick(name):
            return kwargs[name] if kwargs.get(name) is not None else getattr(self, name)

        stop = pick("stop")
        # the knobs left None stay unset: the engine fills them from the model's defaults
        return sampling_params_from(**{k: pick(k) for k in SAMPLING_KNOBS}, max_tokens=pick("max_tokens"),
                                    stop=list(stop) if stop else None, seed=pick("seed"),
                                    output_kind=OutputKind.DELTA)

    def _lora(self, kwargs: dict):
        return kwargs["lora_request"] if kwargs.get("lora_request") is not None else self.lora_request

    def _deadline(self, kwargs: dict) -> float | None:
        import time

        t = kwargs.get("timeout", self.timeout)
        return time.monotonic() + t if t else None

    def _chat(self, messages: Sequence[ChatMessage]):
        """The prompt of a chat call: the messages, or with images token ids + images."""
        engine, images = self.bridge.engine, []
        return chat_prompt(engine, _messages(messages, images, image_token(engine)), images)

    # ---------------------------------------------------------------- streams (the primitives)

    def _texts(self, prompt, kwargs) -> Iterator[tuple[str, RequestOutput]]:
        for out in self.bridge.stream(prompt, self._params(kwargs), deadline=self._deadline(kwargs),
                                      lora_request=self._lora(kwargs)):
            yield (out.outputs[0].text if out.outputs else ""), out

    async def _atexts(self, prompt, kwargs) -> AsyncIterator[tuple[str, RequestOutput]]:
        stream = self.bridge.astream(prompt, self._params(kwargs), deadline=self._deadline(kwargs),
                                     lora_request=self._lora(kwargs))
        try:
            async for out in stream:
                yield (out.outputs[0].text if out.outputs else ""), out
        finally:
            await stream.aclose()

    @staticmethod
    def _raw(out: RequestOutput, n_out: int) -> dict:
        c = out.outputs[0]
        return {"finish_reason": c.finish_reason, "prompt_tokens": len(out.prompt_token_ids or []),
                "completion_tokens": n_out}

    # ---------------------------------------------------------------- chat

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        def gen() -> ChatResponseGen:
            text, n = "", 0
            for delta, out in self._texts(self._chat(messages), kwargs):
                text += delta
                n += len(out.outputs[0].token_ids) if out.outputs else 0
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta,
                                   raw=self._raw(out, n) if out.finished else None)
        return gen()

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        last = None
        for last in self.stream_chat(messages, **kwargs):
            pass
        return ChatResponse(message=last.message, raw=last.raw)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        async def gen() -> ChatResponseAsyncGen:
            text, n = "", 0
            async for delta, out in self._atexts(self._chat(messages), kwargs):
                text += delta
                n += len(out.outputs[0].token_ids) if out.outputs else 0
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta,
                                   raw=self._raw(out, n) if out.finished else None)
        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        last = None
        async for last in await self.astream_chat(messages, **kwargs):
            pass
        return ChatResponse(message=last.message, raw=last.raw)

    # ---------------------------------------------------------------- completion (raw text, no template)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        def gen() -> CompletionResponseGen:
            text, n = "", 0
            for delta, out in self._texts(prompt, kwargs):
                text += delta
                n += len(out.outputs[0].token_ids) if out.outputs else 0
                yield CompletionResponse(text=text, delta=delta, raw=self._raw(out, n) if out.finished else None)
        return gen()

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        last = None
        for last in self.stream_complete(prompt, formatted, **kwargs):
            pass
        return CompletionResponse(text=last.text, raw=last.raw)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        async def gen() -> CompletionResponseAsyncGen:
            text, n = "", 0
            async for delta, out in self._atexts(prompt, kwargs):
                text += delta
                n += len(out.outputs[0].token_ids) if out.outputs else 0
                yield CompletionResponse(text=text, delta=delta, raw=self._raw(out, n) if out.finished else None)
        return gen()

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        last = None
        async for last in await self.astream_complete(prompt, formatted, **kwargs):
            pass
        return CompletionResponse(text=last.text, raw=last.raw)


__all__ = ["AsyncEngineLLM"]
