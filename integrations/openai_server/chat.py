"""OpenAI's /v1/chat/completions: the conversation through the model's chat template (with its
tools and ``chat_template_kwargs``), the output read by the server's parsers (chat_parsers:
reasoning apart in ``reasoning_content``, tool calls in the model's own format), answered whole or
as a stream of deltas (a call's name first, then its arguments in pieces)."""
from __future__ import annotations

import time
import uuid

import msgspec

from starlette.requests import Request
from starlette.responses import Response

from asyncengine.config.request_limits import RequestLimitError
from asyncengine.structured import StructuredOutputsParams

from ..chat_parsers import MessageDelta, OutputParser, ParsedMessage, reasoning_format
from . import guided, media
from .chat_render import template_kwargs
from .completions import sse_events, whole_response
from .errors import APIError
from .generation import chat_logprobs, sampling_params
from .protocol import ChatCompletionRequest
from .sse import SSEResponse, run_until_disconnect
from .state import ServerState, server_state as _state
from .tools import ToolPlan


class ChatPlan:
    """One request's tools, template options and output parsing, by the server's ChatConfig."""

    def __init__(self, st: ServerState, req) -> None:
        cfg = st.chat_config
        try:
            self.tools = ToolPlan(getattr(req, "tools", None), getattr(req, "tool_choice", None),
                                  getattr(req, "parallel_tool_calls", None))
        except RequestLimitError as e:
            raise APIError(400, str(e), param=e.param) from None
        self.native = cfg.native_tools
        self.auto_allowed = cfg.enable_auto_tool_choice or not self.native
        self.kwargs = template_kwargs(cfg, getattr(req, "chat_template_kwargs", None))
        self.tool_parser = cfg.tool_call_parser or "json_array"
        self.reasoning = cfg.reasoning_parser
        self.reasoning_budget = getattr(req, "max_reasoning_tokens", None)
        if self.reasoning_budget is not None and self.reasoning is None:
            raise APIError(400, "max_reasoning_tokens needs the server started with --reasoning-parser",
                           param="max_reasoning_tokens")

    def check_generation(self) -> None:
        """A model may call tools on its own only where the server reads its format (vLLM's rule)."""
        if self.tools.mode == "auto" and not self.auto_allowed:
            raise APIError(400, '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                                "(and --tool-call-parser)", param="tool_choice")

    async def prompt(self, st: ServerState, messages) -> list[int]:
        if self.native:
            return await st.chat_prompt(messages, tools=self.tools.specs if self.tools.mode != "none" else [],
                                        template_kwargs=self.kwargs)
        return await st.chat_prompt(messages, self.tools.prompt(), template_kwargs=self.kwargs)

    def reasoning_gate(self, st: ServerState, params):
        """``params`` with its grammar held back until the reasoning span ends (and the span held
        to ``max_reasoning_tokens``), when the model reasons in this request."""
        rsn = reasoning_format(self.reasoning, self.kwargs) if self.reasoning else None
        so = params.structured_outputs
        if rsn is None or not rsn.thinking or (so is None and self.reasoning_budget is None):
            return params
        end = st.engine.tokenizer.encode(rsn.END, add_special_tokens=False)
        gated = msgspec.structs.replace(so, after=end, reasoning_budget=self.reasoning_budget) if so is not None \
            else StructuredOutputsParams(after=end, reasoning_budget=self.reasoning_budget)
        return msgspec.structs.replace(params, structured_outputs=gated)

    def parser(self) -> OutputParser:
        """A fresh parser for one choice."""
        rsn = reasoning_format(self.reasoning, self.kwargs) if self.reasoning else None
        return self.tools.output_parser(self.tool_parser, rsn)


def delta_json(d: MessageDelta) -> dict:
    """A chat.completion.chunk's ``delta`` for what a parser step added."""
    out: dict = {}
    if d.reasoning:
        out["reasoning_content"] = d.reasoning
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        calls = []
        for tc in d.tool_calls:
            fn = {"arguments": tc.arguments}
            item: dict = {"index": tc.index}
            if tc.name is not None:
                item.update(id=tc.id, type="function")
                fn = {"name": tc.name, "arguments": tc.arguments}
            item["function"] = fn
            calls.append(item)
        out["tool_calls"] = calls
    return out


def message_json(m: ParsedMessage) -> dict:
    """A whole chat.completion ``message``."""
    out: dict = {"role": "assistant", "content": m.content}
    if m.reasoning is not None:
        out["reasoning_content"] = m.reasoning
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    return out


def _merge(a: MessageDelta, b: MessageDelta) -> MessageDelta:
    return MessageDelta(content=a.content + b.content, reasoning=a.reasoning + b.reasoning,
                        tool_calls=a.tool_calls + b.tool_calls)


async def chat_completions(request: Request) -> Response:
    st = _state(request)
    req: ChatCompletionRequest = await st.read_json(request, ChatCompletionRequest)
    lora = st.resolve_model(req.model)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens=max_tokens, logprobs=k, stream=bool(req.stream), limits=st.limits)
    st.check_params(params, req.n)  # before the messages are rendered
    plan = ChatPlan(st, req)
    plan.check_generation()
    messages, image_urls = media.split_images(req.messages, st.engine)  # image parts: the image token
    ids = await plan.prompt(st, messages)
    mm_data = None
    if image_urls:  # fetched or read as the server's flags allow; decoded and checked by the engine
        mm = media.processor_of(st.engine)
        mm_data = {"image": await media.load_sources(image_urls, st.media, mm.limits.max_bytes)}
    # each image's placeholder rows beyond its one token, where they are known before decoding it (a
    # dynamic-resolution model's rows depend on the image's size: the engine checks those after)
    per_image = media.processor_of(st.engine).tokens_per_image if image_urls else None
    n_prompt = len(ids) + len(image_urls) * ((per_image or 1) - 1)
    st.check_length(n_prompt, max_tokens, "messages")
    so, field = guided.requested(req)
    # compiled while watching the client: one that leaves cancels its compile (the worker is killed)
    params = await run_until_disconnect(request, st.constrain(params, plan.tools.structured(), so, field))
    params = plan.reasoning_gate(st, params)  # a grammar starts after the reasoning span
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await st.submit([(None, ids)], params, req.n, rid, lora, multi_modal_data=mm_data)
    head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": lora.name if lora else st.model_name}
    parsers = [plan.parser() for _ in range(len(streams))]

    def finish_reason(i: int, out) -> str | None:
        called = parsers[i].result().tool_calls if out.finish_reason == "stop" else None
        return "tool_calls" if called else out.finish_reason

    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        head["object"] = "chat.completion.chunk"

        def choice(i: int, out, c) -> dict | None:
            lp = {"content": chat_logprobs(c.logprobs, k, st.token_bytes)} if k is not None else None
            d = parsers[i].feed(c.text)
            if out.finished:
                d = _merge(d, parsers[i].finish())
            if not (d or out.finished or (lp is not None and lp["content"])):
                return None
            ch = {"index": i, "delta": delta_json(d), "logprobs": lp}
            if out.finished:
                ch["finish_reason"] = finish_reason(i, out)
            return ch

        first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(len(streams))]
        return SSEResponse(sse_events(st, head, streams, n_prompt, include_usage, first, choice))

    def whole_choice(i: int, out, c) -> dict:
        parsers[i].feed(c.text)
        return {"index": i, "message": message_json(parsers[i].result()),
                "logprobs": {"content": chat_logprobs(c.logprobs, k, st.token_bytes)} if k is not None else None,
                "finish_reason": finish_reason(i, out), "stop_reason": c.stop_reason}

    return await whole_response(request, st, streams, head, n_prompt, whole_choice)
