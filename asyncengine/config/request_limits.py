"""What one request may cost: :class:`RequestLimits`, set on the engine config
(``EngineConfig(limits=RequestLimits(...))``) and applied by engine/validation.py. A module of its own
so the config (below the engine) and the engine's checks (above it) both import it downward."""
from __future__ import annotations

import msgspec

from asyncengine.errors import ConfigError, InvalidRequestError

__all__ = ["CHARS_PER_TOKEN", "RequestLimitError", "RequestLimits"]

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
