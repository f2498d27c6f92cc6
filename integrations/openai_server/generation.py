"""From API requests to engine requests and back: SamplingParams, the n > 1 fan-out, merging the
streams of several samples, and OpenAI's logprobs shapes."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import msgspec

from asyncengine.config.request_limits import RequestLimits
from asyncengine.errors import InvalidRequestError
from asyncengine.engine.protocol import OutputStream
from asyncengine.outputs import CompletionOutput, Logprob, RequestOutput
from asyncengine.sampling_params import OutputKind, SamplingParams

from .errors import APIError, from_engine
from .protocol import SamplingFields

_SEED_MOD = 2**63  # OpenAI's seed is any int64; the engine's is [0, 2**63)


def sampling_params(req: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                    stream: bool, limits: RequestLimits | None = None) -> SamplingParams:
    """The SamplingParams of one prompt's samples (n is set by submit_n). The engine validates
    them (validation.py); ``limits`` only guards the conversions done here. Fields the request
    leaves out (None) stay unset: the engine fills them from the model's defaults
    (asyncengine/models/sampling_defaults.py), as for every front end."""
    kw: dict = {}
    if limits is not None and req.logit_bias and len(req.logit_bias) > limits.max_logit_bias:
        raise APIError(400, f"the number of logit_bias entries is {len(req.logit_bias)}, over the limit "
                            f"max_logit_bias={limits.max_logit_bias}", param="logit_bias", code="limit_exceeded")
    if req.temperature is not None:
        kw["temperature"] = req.temperature
    if req.top_p is not None:
        kw["top_p"] = max(req.top_p, 1e-9)  # OpenAI allows 0: keep only the most likely token
    for name in ("presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty"):
        v = getattr(req, name)
        if v is not None:
            kw[name] = v
    if max_tokens is not None:
        kw["max_tokens"] = max_tokens
    if req.seed is not None:
        kw["seed"] = req.seed % _SEED_MOD  # OpenAI's seed is any int64; the engine's is [0, 2**63)
    if req.logit_bias:
        try:
            kw["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids (integers as strings)",
                           param="logit_bias") from None
    stop = req.stop
    if isinstance(stop, list) and not stop:
        stop = None
    try:
        return SamplingParams(
            n=1, stop=stop, stop_token_ids=req.stop_token_ids or None,
            ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
            output_kind=OutputKind.DELTA if stream else OutputKind.FINAL_ONLY, **kw)
    except InvalidRequestError as e:
        raise from_engine(e, None) from None


def submit_n(engine, prompt, params: SamplingParams, n: int, request_id: str, lora_request=None) -> OutputStream:
    """One prompt's ``n`` samples as one engine stream (engine-native n: the samples share the
    prompt's KV blocks; sample i is seeded ``seed + i`` when a seed is given)."""
    if n != params.n:
        params = msgspec.structs.replace(params, n=n)
    return engine.generate(prompt, params, request_id=request_id, lora_request=lora_request)


class Submission:
    """Every choice of one API request: one engine stream per prompt, each carrying ``n`` samples.
    ``len()`` is the number of choices (choice index = prompt index * n + sample index)."""

    def __init__(self, streams: Sequence[OutputStream], n: int) -> None:
        self.streams = list(streams)
        self.n = n

    def __len__(self) -> int:
        return len(self.streams) * self.n

    async def aclose(self) -> None:
        for s in self.streams:
            await s.aclose()


def _one_sample(out: RequestOutput, c: CompletionOutput) -> RequestOutput:
    return RequestOutput(request_id=out.request_id, prompt=out.prompt, prompt_token_ids=out.prompt_token_ids,
                         outputs=[c], finished=c.finish_reason is not None, metrics=out.metrics,
                         num_cached_tokens=out.num_cached_tokens)


async def merge_streams(sub: Submission) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, that sample's output) from all the streams as they come. At most one read is
    outstanding per stream, so each stream keeps merging its deltas while the consumer is slow.
    Leaving early (break, aclose, cancellation, an error) aborts every unfinished stream."""
    streams, n = sub.streams, sub.n
    pending: dict[asyncio.Future, int] = {}
    try:
        pending = {asyncio.ensure_future(s.__anext__()): p for p, s in enumerate(streams)}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=pending.__getitem__):
                p = pending.pop(fut)
                try:
                    out = fut.result()
                except StopAsyncIteration:
                    continue
                if not out.finished:
                    pending[asyncio.ensure_future(streams[p].__anext__())] = p
                for c in out.outputs:
                    yield p * n + c.index, _one_sample(out, c)
    finally:
        for fut in pending:
            if fut.done():
                if not fut.cancelled():
                    fut.exception()  # retrieved: no "never retrieved" warning
            else:
                fut.cancel()
        await sub.aclose()


# ---------------------------------------------------------------- logprobs

def _token_str(lp: Logprob, tid: int) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{tid}"


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of a position (the engine's entry holds the sampled token first,
    with its true rank, then the top-k by rank)."""
    ranked = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and 1 <= lp.rank <= k]
    ranked.sort(key=lambda t: t[1].rank)
    return ranked


def _sampled(entry: dict[int, Logprob]) -> tuple[int, Logprob]:
    tid = next(iter(entry))
    return tid, entry[tid]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are spelt in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_UNICODE_TO_BYTE = {u: b for b, u in _bytes_to_unicode().items()}


class TokenBytes:
    """A token's raw UTF-8 bytes (chat logprobs' ``bytes``): with a byte-level BPE tokenizer, the
    exact bytes of the piece, so clients can join tokens that split a character; otherwise the
    UTF-8 of its decoded text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = False
        try:
            self.byte_level = "ByteLevel" in repr(tokenizer.backend_tokenizer.decoder)
        except Exception:
            pass
        self._cache: dict[int, list[int]] = {}

    def __call__(self, tid: int, text: str) -> list[int]:
        if not self.byte_level:
            return list(text.encode("utf-8"))
        b = self._cache.get(tid)
        if b is None:
            try:
                piece = self.tokenizer.convert_ids_to_tokens(tid)
            except Exception:
                piece = None
            if isinstance(piece, str) and piece and all(c in _UNICODE_TO_BYTE for c in piece):
                b = [_UNICODE_TO_BYTE[c] for c in piece]
            else:
                b = list(text.encode("utf-8"))
            if len(self._cache) < 1 << 16:
                self._cache[tid] = b
        return b


def chat_logprobs(entries, k: int, token_bytes: TokenBytes | None = None) -> list[dict]:
    """Chat's ``logprobs.content`` items for some positions."""

    def item(tid: int, lp: Logprob) -> dict:
        tok = _token_str(lp, tid)
        return {"token": tok, "logprob": lp.logprob,
                "bytes": token_bytes(tid, tok) if token_bytes is not None else list(tok.encode("utf-8"))}

    content = []
    for entry in entries or ():
        if not entry:
            continue
        tid, lp = _sampled(entry)
        content.append({**item(tid, lp), "top_logprobs": [item(i, t) for i, t in _top(entry, k)]})
    return content


def completion_logprobs(entries, k: int, offset: int) -> tuple[dict, int]:
    """The legacy completions ``logprobs`` object for some positions (text offsets from
    ``offset``); returns it and the offset after them. As OpenAI documents, top_logprobs always
    holds the sampled token too, so up to k + 1 entries."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for entry in entries or ():
        if not entry:
            continue
        tid, lp = _sampled(entry)
        tok = _token_str(lp, tid)
        tokens.append(tok)
        token_lps.append(lp.logprob)
        top = {tok: lp.logprob}
        for i, t in _top(entry, k):
            top.setdefault(_token_str(t, i), t.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset
