"""Input processing: prompts and parameters in, validated core ``Request``s out.

Everything that can be wrong with a request is caught here, before it reaches the scheduler, with
an ``InvalidRequestError`` naming the problem; the engine itself never sees a bad request.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from asyncengine.core.request import Request
from asyncengine.errors import InvalidRequestError
from asyncengine.sampling_params import SamplingParams

PromptType = str | Sequence[int] | Mapping


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, prompt token ids)."""
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer (skip_tokenizer_init or none in the "
                                          "checkpoint): give prompts as token ids")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
            return None, self._check_ids(prompt)
        raise InvalidRequestError(f"a prompt must be a string, a list of token ids or a dict, "
                                  f"not {type(prompt).__name__}")

    def _check_ids(self, ids) -> list[int]:
        ids = list(ids)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise InvalidRequestError("prompt token ids must be integers")
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise InvalidRequestError(f"prompt token id {i} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def make_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None,
                     priority: int = 0, cache_salt: str | None = None,
                     arrival_time: float | None = None) -> tuple[Request, str | None]:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, not {type(params).__name__}")
        text, ids = self.tokenize(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty (no tokens)")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt is {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                f"it must be shorter to leave room for at least one output token")
        self._check_sampling_ids(params)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        bad_words = None
        if params.bad_words:
            if self.tokenizer is None:
                raise InvalidRequestError("bad_words needs a tokenizer")
            bad_words = []
            for w in params.bad_words:
                for variant in (w, " " + w.lstrip()):
                    toks = self.tokenizer.encode(variant, add_special_tokens=False)
                    if toks and toks not in bad_words:
                        bad_words.append(toks)
        req = Request(request_id=request_id, prompt_token_ids=ids, sampling_params=params,
                      eos_token_ids=self.eos_token_ids, max_tokens=max_tokens, priority=priority,
                      cache_salt=cache_salt, bad_words_token_ids=bad_words,
                      arrival_time=arrival_time if arrival_time is not None else time.monotonic())
        return req, text

    def _check_sampling_ids(self, p: SamplingParams) -> None:
        for name, ids in (("logit_bias", (p.logit_bias or {}).keys()), ("allowed_token_ids", p.allowed_token_ids or ()),
                          ("stop_token_ids", p.stop_token_ids or ())):
            for i in ids:
                if not 0 <= int(i) < self.vocab_size:
                    raise InvalidRequestError(f"{name}: token id {i} is outside the vocabulary [0, {self.vocab_size})")
