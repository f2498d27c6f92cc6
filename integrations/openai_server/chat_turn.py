"""One assistant turn for the endpoints built on chat (the Responses and Messages APIs): the same
steps as /v1/chat/completions (sampling defaults, the engine's checks, the tools' prompt and
grammar, structured outputs after the reasoning span, submission) for one sample, and its outputs
with the server's metrics."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request

from asyncengine.errors import AsyncEngineError
from asyncengine.outputs import RequestOutput

from . import guided
from .errors import from_engine
from .generation import Submission, merge_streams, sampling_params
from .protocol import SamplingFields
from .sse import run_until_disconnect
from .tool_adapter import ToolSession


@dataclass(slots=True)
class Turn:
    streams: Submission
    prompt_tokens: int


async def start_turn(request: Request, st, fields: SamplingFields, messages: list[dict], tools: ToolSession,
                     max_tokens: int | None, stream: bool, request_id: str, what: str = "messages") -> Turn:
    """Check, render and submit one turn (``messages``: OpenAI chat messages; ``fields``: the
    sampling knobs and structured-output fields, as chat's). ``what`` names the input in errors."""
    params = sampling_params(fields, max_tokens=max_tokens, logprobs=None, stream=stream, limits=st.limits)
    st.check_params(params, 1)  # before the messages are rendered
    tools.check_generation()
    ids = await tools.prompt_ids(st, messages)
    st.check_length(len(ids), max_tokens, what)
    so, field = guided.requested(fields)
    # compiled while watching the client: one that leaves cancels its compile; a forced tool call
    # streams too (the endpoints hold what they must parse whole: tool_adapter.py)
    params = await run_until_disconnect(request, st.constrain(params, tools.structured(), so, param=field))
    params = tools.gate(st, params)  # a grammar starts after the reasoning span
    streams = await st.submit([(None, ids)], params, 1, request_id, st.resolve_model(fields.model))
    return Turn(streams, len(ids))


async def outputs(st, turn: Turn) -> AsyncIterator[RequestOutput]:
    """The sample's outputs as they come (deltas when streaming, else the final one), counted in
    the server's metrics (an unfinished one as an abort). Engine errors become APIErrors."""
    count = 0
    finished = False
    try:
        async for _, out in merge_streams(turn.streams):
            count += len(out.outputs[0].token_ids)
            if out.finished:
                finished = True
                st.metrics.observe(out, count)
            yield out
    except AsyncEngineError as e:
        raise from_engine(e, st.engine) from None
    finally:
        if not finished:
            st.metrics.finished.labels("abort").inc()


@dataclass
class Tally:
    """What a streamed turn's end needs: its last output and the tokens counted."""
    last: RequestOutput | None = None
    tokens: int = 0


async def tool_events(st, turn: Turn, tools: ToolSession, tally: Tally) -> AsyncIterator:
    """The tool seam's events (tool_adapter.py) of a streamed turn, read off its outputs as they
    come; ``tally`` keeps the last output and the token count for the closing events."""
    parser = tools.parser()
    async for out in outputs(st, turn):
        tally.last = out
        tally.tokens += len(out.outputs[0].token_ids)
        for ev in parser.feed(out.outputs[0].text) + (parser.finish() if out.finished else []):
            yield ev


async def final_output(request: Request, st, turn: Turn) -> tuple[RequestOutput, int]:
    """(the final output, its number of tokens); ClientGone if the client leaves first (the
    request is aborted)."""
    got: list = [None, 0]

    async def collect() -> None:
        async for out in outputs(st, turn):
            got[0] = out
            got[1] += len(out.outputs[0].token_ids)

    await run_until_disconnect(request, collect())
    return got[0], got[1]


def finish_kind(out: RequestOutput) -> tuple[str, str | None]:
    """("stop" | "length" | other, the stop string that ended it or None)."""
    c = out.outputs[0]
    stop = c.stop_reason if isinstance(c.stop_reason, str) else None
    return out.finish_reason or "stop", stop
