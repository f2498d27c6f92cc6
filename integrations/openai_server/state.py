"""What every handler of the server needs, and the request steps they share: the engine and its
names and limits, reading a body within its size limit (413) and decoding it within its nesting
limit, turning prompts and chat messages into token ids, compiling a request's structured output
off the loop, and submitting every sample of a request or none."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from asyncengine.config import request_limits
from asyncengine.errors import AsyncEngineError, InvalidRequestError

from . import chat_render
from .errors import APIError, from_engine
from .generation import Submission, TokenBytes, submit_n
from .media import MediaPolicy
from .metrics import ServerMetrics
from .protocol import ChatMessage, decode
from .responses_store import ResponseStore
from .security import SecurityPolicy
from ..tool_calls import openai_history, with_tools_prompt

_OFF_LOOP_BYTES = 256 * 1024
DRAIN_FACTOR = 4  # an oversized body is read and dropped up to this many times the limit...
DRAIN_S = 2.0  # ...for at most this long, so that the client reads its 413 (read_json)


async def _drain(stream, budget: int) -> None:
    async def run() -> None:
        left = budget
        async for chunk in stream:
            left -= len(chunk)
            if left < 0:
                return

    try:
        await asyncio.wait_for(run(), DRAIN_S)
    except (asyncio.TimeoutError, Exception):
        pass  # a slow or vanished client: answered (and closed) now


_CLOSE = {"connection": "close"}  # an oversized body is not read on past the drain: end the connection


def decode_checked(body: bytes, typ: type, limits: request_limits.RequestLimits):
    """JSON bytes -> a validated ``typ``, its nesting checked before it is decoded."""
    try:
        request_limits.check_json_depth(body, limits)
    except request_limits.RequestLimitError as e:
        raise APIError(400, str(e), param="body", code="limit_exceeded") from None
    return decode(body, typ)


def token_ids(items: list) -> list[int] | None:
    """A JSON list of token ids (integral floats such as 7.0 count: JSON has one number type)."""
    out = []
    for t in items:
        if type(t) is int:
            out.append(t)
        elif type(t) is float and t.is_integer() and abs(t) < 2**53:
            out.append(int(t))
        else:
            return None
    return out


class ServerState:
    """What every handler needs: the engine, names, limits, metrics."""

    def __init__(self, engine, served_model_name: str, policy: SecurityPolicy, web_chat_dir: Path | None,
                 chat_config: chat_render.ChatConfig | None = None) -> None:
        self.engine = engine
        self.chat_config = chat_config or chat_render.ChatConfig()
        self.model_name = served_model_name
        self.policy = policy
        self.limits: request_limits.RequestLimits = engine.limits
        self.metrics = ServerMetrics(engine)
        self.token_bytes = TokenBytes(engine.tokenizer)
        self.web_chat_dir = web_chat_dir
        self.created = int(time.time())
        self.shutting_down = False
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's loop, once started
        self.responses = ResponseStore()  # the Responses API's (build_app sizes it)
        self.media = MediaPolicy()  # which image URLs chat requests may name (media.py; build_app sets it)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # ------------------------------------------------------------ checks

    def resolve_model(self, name: str | None):
        """The LoRARequest the ``model`` field names (None: the base model); an unknown name is 404."""
        if name is None or name == self.model_name:
            return None
        lora = self.engine.get_lora(name)
        if lora is None:
            raise APIError(404, f"The model `{name}` does not exist (this server serves `{self.model_name}`"
                                f"{' and its LoRA adapters' if self.engine.list_loras() else ''}).",
                           param="model", code="model_not_found")
        return lora

    def check_length(self, num_prompt: int, max_tokens: int | None, what: str) -> None:
        limit = self.max_model_len
        if num_prompt >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your "
                                f"{what} resulted in {num_prompt} tokens, leaving no room for the completion. "
                                f"Please shorten the {what}.", param=what, code="context_length_exceeded")
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{num_prompt + max_tokens} tokens ({num_prompt} in the {what}, {max_tokens} in "
                                f"the completion). Please reduce the length of the {what} or completion.",
                           param="max_tokens", code="context_length_exceeded")

    # ------------------------------------------------------------ inputs

    async def read_json(self, request: Request, typ: type):
        """The body as a validated ``typ``: its size bounded before it is read in full (413, for
        chunked bodies too), its nesting before it is decoded.

        An oversized body is read on and discarded (at most ``DRAIN_FACTOR`` x the limit, for at most
        ``DRAIN_S``) before the 413 goes out: a server that closes while the client still sends makes
        the client's TCP stack drop the answer (AsyncOpenAI saw ``ReadError``, not the 413). A body
        announced larger than that bound, or not finished in time, is answered at once."""
        limits = self.limits
        cap = limits.max_request_bytes
        length = request.headers.get("content-length")
        declared = None
        if length is not None:
            try:
                declared = int(length)
                request_limits.check_body_size(declared, limits)
            except request_limits.RequestLimitError as e:
                if declared > DRAIN_FACTOR * cap:
                    raise APIError(413, str(e), param="body", code="request_too_large", headers=_CLOSE) from None
                await _drain(request.stream(), DRAIN_FACTOR * cap)
                raise APIError(413, str(e), param="body", code="request_too_large", headers=_CLOSE) from None
            except ValueError:
                raise APIError(400, "invalid Content-Length") from None
        chunks, size = [], 0
        stream = request.stream()
        async for chunk in stream:
            size += len(chunk)
            if size > cap:
                await _drain(stream, DRAIN_FACTOR * cap - size)
                raise APIError(413, f"the request body is over the limit max_request_bytes="
                                    f"{cap}", param="body", code="request_too_large", headers=_CLOSE)
            chunks.append(chunk)
        body = b"".join(chunks)
        if len(body) > _OFF_LOOP_BYTES:  # scanning and decoding megabytes: not on the event loop
            return await asyncio.to_thread(decode_checked, body, typ, limits)
        return decode_checked(body, typ, limits)

    async def encode(self, item, param: str) -> tuple[str | None, list[int]]:
        """A text, a list of token ids or chat messages -> (text or None, checked ids), by the
        engine's own rules (long ones tokenized off the event loop)."""
        try:
            return await self.engine.encode(item)
        except AsyncEngineError as e:
            err = from_engine(e, self.engine)
            if err.status == 400:  # the input's fault: name the field (never on a dead engine's 503)
                err.param = err.param or param
            raise err from None

    def check_params(self, params, n: int) -> None:
        """The sampling parameters by the engine's rules, before any prompt is tokenized."""
        try:
            self.engine.check_sampling_params(msgspec.structs.replace(params, n=n) if n != params.n else params)
        except AsyncEngineError as e:
            raise from_engine(e, self.engine) from None

    async def completion_prompts(self, prompt) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, list) and len(prompt) > max(self.max_model_len, self.limits.max_prompts):
            # more items than any prompt list can have: refused before looking at each of them
            raise APIError(400, f"the prompt list has {len(prompt)} items: at most max_prompts="
                                f"{self.limits.max_prompts} prompts, or fewer than max_model_len="
                                f"{self.max_model_len} token ids", param="prompt", code="limit_exceeded")
        if isinstance(prompt, str):
            items = [prompt]
        elif not prompt:
            raise APIError(400, "prompt must not be an empty list", param="prompt")
        elif all(isinstance(p, str) for p in prompt):
            items = list(prompt)
        elif (ids := token_ids(prompt)) is not None:
            items = [ids]
        elif all(isinstance(p, list) for p in prompt) and None not in (lists := [token_ids(p) for p in prompt]):
            items = lists
        else:
            raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list "
                                "of lists of token ids", param="prompt")
        if len(items) > self.limits.max_prompts:
            raise APIError(400, f"the number of prompts is {len(items)}, over the limit max_prompts="
                                f"{self.limits.max_prompts}", param="prompt", code="limit_exceeded")
        if sum(len(it) for it in items if isinstance(it, str)) > self.limits.prompt_chars(self.max_model_len):
            raise APIError(400, f"the prompts' length (characters) is over the limit max_prompt_chars="
                                f"{self.limits.prompt_chars(self.max_model_len)}", param="prompt",
                           code="limit_exceeded")
        return [await self.encode(it, "prompt") for it in items]

    async def chat_prompt(self, messages: list[ChatMessage], tools_text: str | None = None, *,
                          tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """The conversation's token ids through the model's chat template (chat_render.py). With
        ``tools`` (a native tool-call parser), the tools and earlier calls go to the template as
        transformers defines them; otherwise earlier calls are folded into the text and the tools
        are described by ``tools_text`` in a system message (integrations/tool_calls.py)."""
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer, so it cannot chat: use /v1/completions with "
                                "token ids", param="messages")
        raw = msgspec.to_builtins(messages)
        if tools is None:
            try:
                raw = with_tools_prompt(openai_history(raw), tools_text)
            except request_limits.RequestLimitError as e:
                raise APIError(400, str(e), param=e.param) from None
        msgs = chat_render.checked_messages(raw, self.engine)
        ids = await asyncio.to_thread(chat_render.render, tok, msgs, tools, template_kwargs or {})
        self.check_length(len(ids), None, "messages")
        _, ids = await self.encode(ids, "messages")  # the engine's checks of token ids
        return ids

    # ------------------------------------------------------------ engine

    async def constrain(self, params, from_tools, from_request, param: str | None = None):
        """``params`` with the request's structured output (``from_tools``: a forced tool call;
        ``from_request``: response_format or vLLM's fields, named ``param``), compiled first
        (structured/compile_service.py: off the loop, within the grammar limits): a grammar that
        cannot compile, or is over a limit, is a 400 with the reason."""
        if from_tools is not None and from_request is not None:
            raise APIError(400, f"give {param or 'response_format'} or a tool_choice that forces a tool call, "
                                "not both", param=param or "response_format")
        so = from_tools or from_request
        if so is None:
            return params
        params = msgspec.structs.replace(params, structured_outputs=so)
        try:
            params = await self.engine.check_structured_outputs(params)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param="tools" if from_tools is not None else (param or "response_format"),
                           code="limit_exceeded" if getattr(e, "limit", None) else None) from None
        except AsyncEngineError as e:
            raise from_engine(e, self.engine) from None
        return params

    async def submit(self, prompts: list[tuple[str | None, list[int]]], params, n: int,
                     request_id: str, lora_request=None, multi_modal_data=None) -> Submission:
        """Every sample of every prompt (choice index = prompt index * n + sample), or none.
        ``multi_modal_data``: the images of a one-prompt chat request (media.py)."""
        streams: list = []
        try:
            for p, (text, ids) in enumerate(prompts):
                prompt = {"prompt": text, "prompt_token_ids": ids} if text is not None else {"prompt_token_ids": ids}
                if multi_modal_data is not None:
                    prompt["multi_modal_data"] = multi_modal_data
                streams.append(submit_n(self.engine, prompt, params, n, f"{request_id}-{p}", lora_request))
        except BaseException as e:
            await Submission(streams, n).aclose()
            if isinstance(e, (AsyncEngineError, APIError)):
                raise from_engine(e, self.engine) from None
            raise
        return Submission(streams, n)


def json_response(obj, status: int = 200, headers: dict | None = None) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, headers=headers, media_type="application/json")


def server_state(request) -> ServerState:
    """The server's state, which ``build_app`` puts on the app."""
    return request.app.state.server
