"""OpenAI's /v1/completions: read and check the body, submit the samples, answer with one JSON or a
server-sent-event stream (app.py routes it), and the answering steps /v1/chat/completions shares
(chat.py)."""
from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from asyncengine.errors import AsyncEngineError

from . import guided
from .errors import APIError, from_engine
from .generation import Submission, completion_logprobs, merge_streams, sampling_params
from .protocol import CompletionRequest
from .sse import SSE_DONE, ClientGone, SSEResponse, run_until_disconnect, sse_event
from .state import ServerState, json_response as _json, server_state as _state


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _check_samples(st: ServerState, num_prompts: int, n: int) -> None:
    if num_prompts * n > st.limits.max_samples:
        raise APIError(400, f"prompts x n is {num_prompts * n}, over the limit max_samples={st.limits.max_samples}",
                       param="n", code="limit_exceeded")


async def completions(request: Request) -> Response:
    st = _state(request)
    req: CompletionRequest = await st.read_json(request, CompletionRequest)
    lora = st.resolve_model(req.model)
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (only best_of == n)", param="best_of")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported", param="echo")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    _check_samples(st, len(req.prompt) if isinstance(req.prompt, list) and req.prompt
                   and not isinstance(req.prompt[0], (int, float)) else 1, req.n)
    k = req.logprobs
    params = sampling_params(req, max_tokens=req.max_tokens, logprobs=k, stream=bool(req.stream),
                             limits=st.limits)
    st.check_params(params, req.n)  # before any prompt is tokenized
    so, field = guided.requested(req)
    prompts = await st.completion_prompts(req.prompt)
    for _, ids in prompts:
        st.check_length(len(ids), req.max_tokens, "prompt")
    params = await run_until_disconnect(request, st.constrain(params, None, so, field))
    rid = f"cmpl-{uuid.uuid4().hex}"
    streams = await st.submit(prompts, params, req.n, rid, lora)
    n = req.n
    created = int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": lora.name if lora else st.model_name}
    echo_texts = []
    if req.echo:
        tok = st.engine.tokenizer
        echo_texts = [text if text is not None else (tok.decode(ids) if tok is not None else "")
                      for text, ids in prompts]
    prompt_tokens = sum(len(ids) for _, ids in prompts)

    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        offsets = [0] * len(streams)

        def choice(i: int, out, c) -> dict | None:
            lp = None
            if k is not None:
                lp, offsets[i] = completion_logprobs(c.logprobs, k, offsets[i])
            if not (c.text or out.finished or (lp is not None and lp["tokens"])):
                return None
            return {"index": i, "text": c.text, "logprobs": lp}

        first = [{"index": i * n + j, "text": text, "logprobs": None, "finish_reason": None}
                 for i, text in enumerate(echo_texts) for j in range(n)]
        return SSEResponse(sse_events(st, head, streams, prompt_tokens, include_usage, first, choice))

    def whole_choice(i: int, out, c) -> dict:
        text = (echo_texts[i // n] + c.text) if req.echo else c.text
        return {"index": i, "text": text,
                "logprobs": completion_logprobs(c.logprobs, k, 0)[0] if k is not None else None,
                "finish_reason": out.finish_reason, "stop_reason": c.stop_reason}

    return await whole_response(request, st, streams, head, prompt_tokens, whole_choice)


async def sse_events(st, head: dict, streams: Submission, prompt_tokens: int, include_usage: bool,
                      first_choices: list[dict], choice):
    """The SSE stream of a completion or chat request: ``first_choices`` (each in its own event),
    then one event per output that ``choice(i, out, c)`` turns into a choice dict (None = nothing to
    send), the usage if asked for, and ``[DONE]``. Engine errors become an error event."""
    counts = [0] * len(streams)
    finished = set()
    try:
        for c0 in first_choices:
            yield sse_event({**head, "choices": [c0]})
        async for i, out in merge_streams(streams):
            c = out.outputs[0]
            counts[i] += len(c.token_ids)
            ch = choice(i, out, c)
            if ch is not None:
                ch.setdefault("finish_reason", out.finish_reason if out.finished else None)
                if out.finished:
                    ch["stop_reason"] = c.stop_reason
                yield sse_event({**head, "choices": [ch]})
            if out.finished:
                finished.add(i)
                st.metrics.observe(out, counts[i])
        if include_usage:
            yield sse_event({**head, "choices": [], "usage": _usage(prompt_tokens, sum(counts))})
    except (AsyncEngineError, APIError) as e:
        yield sse_event(from_engine(e, st.engine).body())
    finally:
        if len(finished) < len(streams):
            st.metrics.finished.labels("abort").inc(len(streams) - len(finished))
    yield SSE_DONE


async def whole_response(request: Request, st, streams: Submission, head: dict, prompt_tokens: int,
                          choice) -> Response:
    """The non-streaming answer of both endpoints: every choice's final output, each made into the
    endpoint's choice by ``choice(index, output, completion)``, counted, with the usage. If the
    client leaves first, the requests are aborted and counted, and the answer is a bare 499."""
    try:
        finals = await _collect_finals(request, st, streams)
    except ClientGone:
        return Response(status_code=499)
    choices = []
    completion_tokens = 0
    for i, out in enumerate(finals):
        c = out.outputs[0]
        completion_tokens += len(c.token_ids)
        st.metrics.observe(out, len(c.token_ids))
        choices.append(choice(i, out, c))
    return _json({**head, "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)})


async def _collect_finals(request: Request, st, streams: Submission) -> list:
    """Every choice's final output. If the client leaves first, the requests are aborted, counted,
    and ClientGone propagates."""
    finals: list = [None] * len(streams)

    async def collect():
        async for i, out in merge_streams(streams):
            finals[i] = out

    try:
        await run_until_disconnect(request, collect())
    except ClientGone:
        st.metrics.finished.labels("abort").inc(sum(f is None for f in finals))
        raise
    except AsyncEngineError as e:
        raise from_engine(e, st.engine) from None
    return finals
