"""What one request may cost: :class:`RequestLimits`, set on the engine config
(``EngineConfig(limits=RequestLimits(...))``) and applied by engine/validation.py. A module of its own
so the config (below the engine) and the engine's checks (above it) both import it downward."""
from __future__ import annotations

import msgspec

from asyncengine.errors import ConfigError, InvalidRequestError

__all__ = ["CHARS_PER_TOKEN", "RequestLimitError", "RequestLimits", "check_body_size", "check_json_depth"]

# a prompt longer than this many characters per token of max_model_len cannot fit (real text
# averages 3-5 characters a token; even long whitespace runs stay well below 32)
CHARS_PER_TOKEN = 32


class RequestLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one request may cost. Every field is a hard limit; exceeding it is a 4xx naming it.

    * ``max_request_bytes``: an HTTP body or a websocket frame (413 before it is read in full).
    * ``max_json_depth``: nesting of arrays/objects in a JSON body (checked before decoding).
    * ``max_prompt_chars``: characters of a text prompt (or of all chat messages together),
      checked before tokenizing; ``None`` = ``32 x max_model_len`` (no longer text can fit).
    * ``max_prompts``: prompts in one completions request; ``max_samples``: prompts x n.
    * ``max_n``, ``max_logprobs``, ``max_prompt_logprobs``: per request.
    * ``max_stop_strings`` / ``max_stop_string_chars``: how many stop strings, how long each (the
      matcher is linear in their total length anyway).
    * ``max_stop_token_ids``, ``max_logit_bias``, ``max_allowed_token_ids``, ``max_bad_words``:
      entries of those fields (duplicates are dropped first).
    * ``max_messages``: chat messages; ``max_request_id_chars``: a caller-given request id.
    * ``max_concurrent_tokenizations``: long prompts are tokenized on worker threads, at most
      this many at once (the rest wait their turn, off the event loop).
    * ``off_loop_chars``: prompts longer than this are tokenized off the event loop.
    """

    max_request_bytes: int = 4 * 1024 * 1024
    max_json_depth: int = 64
    max_prompt_chars: int | None = None
    max_prompts: int = 256
    max_samples: int = 256
    max_n: int = 128
    max_logprobs: int = 20
    max_prompt_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_string_chars: int = 1024
    max_stop_token_ids: int = 256
    max_logit_bias: int = 1024
    max_allowed_token_ids: int = 65536
    max_bad_words: int = 128
    max_messages: int = 2048
    max_request_id_chars: int = 256
    max_concurrent_tokenizations: int = 2
    off_loop_chars: int = 4096

    def __post_init__(self) -> None:
        for f in self.__struct_fields__:
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"RequestLimits.{f} must be a positive integer, got {v!r}")

    def prompt_chars(self, max_model_len: int) -> int:
        """The character limit of a prompt for a model of ``max_model_len`` tokens."""
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return CHARS_PER_TOKEN * max_model_len


class RequestLimitError(InvalidRequestError):
    """A request over one of the :class:`RequestLimits` (or another rule): ``limit`` names the
    limit, ``param`` the request field. HTTP: 400 (413 for ``max_request_bytes``)."""

    def __init__(self, message: str, *, param: str | None = None, limit: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.limit = limit


def over_limit(what: str, value: int, limit: str, limits: RequestLimits, param: str,
               cap: int | None = None) -> RequestLimitError:
    cap = getattr(limits, limit) if cap is None else cap
    return RequestLimitError(f"{what} is {value}, over the limit {limit}={cap}", param=param, limit=limit)


# ---------------------------------------------------------------- bodies (the server, before any engine code)


def check_body_size(num_bytes: int, limits: RequestLimits) -> None:
    if num_bytes > limits.max_request_bytes:
        raise over_limit("the request body (bytes)", num_bytes, "max_request_bytes", limits, "body")


def check_json_depth(body: bytes, limits: RequestLimits) -> None:
    """Refuse JSON nested deeper than ``max_json_depth`` before a decoder recurses into it.

    Vectorized (numpy), linear in the body and a few bytes of scratch per body byte, whatever the
    body holds (a regex that cuts out strings takes seconds on a body of many small or escaped
    strings). Brackets inside strings do not count; a quote after an odd run of backslashes is
    escaped."""
    limit = limits.max_json_depth
    if body.count(b"[") + body.count(b"{") <= limit:
        return  # cannot be deeper
    import numpy as np

    a = np.frombuffer(body, dtype=np.uint8)
    n = len(a)
    quote = a == 34
    bs = a == 92
    if bs.any():  # quotes escaped by an odd run of backslashes are not string delimiters
        prev = np.empty(n, dtype=bool)
        prev[0] = False
        prev[1:] = bs[:-1]
        nxt = np.empty(n, dtype=bool)
        nxt[-1] = False
        nxt[:-1] = bs[1:]
        starts = np.flatnonzero(bs & ~prev)
        ends = np.flatnonzero(bs & ~nxt)
        after_odd = ends[(ends - starts) % 2 == 0] + 1  # run length (ends - starts + 1) is odd
        after_odd = after_odd[after_odd < n]
        quote[after_odd] = False
        del prev, nxt, starts, ends, after_odd
    in_string = (np.cumsum(quote, dtype=np.int32) & 1).astype(bool)
    del quote, bs
    steps = np.zeros(n, dtype=np.int8)
    steps[((a == 91) | (a == 123)) & ~in_string] = 1
    steps[((a == 93) | (a == 125)) & ~in_string] = -1
    depth = int(np.cumsum(steps, dtype=np.int32).max())
    if depth > limit:
        raise over_limit("the JSON nesting depth", depth, "max_json_depth", limits, "body")
