"""Every rule a request must follow and every limit on what it may cost, in one place.

The in-process engines (``AsyncLLMEngine``, ``LLM``) and the HTTP server apply the same checks
from here, so a request is accepted or refused the same way whichever door it comes through. Each
check runs *before* the work it guards (the characters of a prompt before it is tokenized, the
bytes of a body before it is read, the nesting of JSON before it is decoded), and every refusal is
a :class:`RequestLimitError` / :class:`InvalidRequestError` whose message names the field, the
limit and its value, so a client knows what to change.

Here too: chat message shapes, token-id ranges, request ids. Elsewhere: the value ranges of a
SamplingParams are its own, checked when one is built (sampling_params.py); the HTTP API's
OpenAI-compatible ranges (e.g. temperature <= 2) are in the server's request schema
(integrations/openai_server/protocol.py).

Limits live in :class:`RequestLimits` (request_limits.py, a neutral module that the config imports
too: ``EngineConfig(limits=RequestLimits(...))``, or the ``asyncengine serve`` flags); the defaults
suit a public-facing server and no ordinary request comes near them.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import msgspec

from asyncengine.errors import InvalidRequestError
# the raw-body checks live with the limits (the server runs them before any engine code)
from asyncengine.config.request_limits import CHARS_PER_TOKEN, RequestLimitError, RequestLimits
from asyncengine.config.request_limits import check_body_size, check_json_depth, over_limit as _over
from asyncengine.sampling_params import SamplingParams

__all__ = ["RequestLimits", "RequestLimitError", "check_sampling_params", "check_prompt_chars",
           "check_token_ids", "check_messages", "check_request_id", "check_json_depth",
           "check_body_size", "check_allowed_tokens", "CHAT_ROLES"]

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


# ---------------------------------------------------------------- prompts


def check_request_id(request_id, limits: RequestLimits) -> str:
    if not isinstance(request_id, str) or not request_id:
        raise RequestLimitError(f"request_id must be a non-empty string, not {request_id!r:.40}",
                                param="request_id")
    if len(request_id) > limits.max_request_id_chars:
        raise _over("the request id length", len(request_id), "max_request_id_chars", limits, "request_id")
    return request_id


def check_prompt_chars(text: str, limits: RequestLimits, max_model_len: int, param: str = "prompt") -> None:
    cap = limits.prompt_chars(max_model_len)
    if len(text) > cap:
        raise _over("the prompt length (characters)", len(text), "max_prompt_chars", limits, param, cap)


def check_token_ids(ids, vocab_size: int, what: str = "prompt token ids") -> list[int]:
    ids = list(ids)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise InvalidRequestError(f"{what} must be integers, got {type(i).__name__}")
    for i in ids:
        if not 0 <= i < vocab_size:
            raise InvalidRequestError(f"{what}: token id {i} is outside the vocabulary [0, {vocab_size})")
    return ids


def check_messages(messages, limits: RequestLimits, max_model_len: int) -> list[dict]:
    """Chat messages -> plain ``{"role", "content"}`` dicts a chat template can render: a role from
    :data:`CHAT_ROLES` (``developer`` becomes ``system``), content a string, ``None`` (empty) or
    a list of ``{"type": "text", "text": ...}`` parts (joined with newlines)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise RequestLimitError("messages must be a list of {'role': ..., 'content': ...} objects",
                                param="messages")
    if not messages:
        raise RequestLimitError("messages must not be empty", param="messages")
    if len(messages) > limits.max_messages:
        raise _over("the number of messages", len(messages), "max_messages", limits, "messages")
    out: list[dict] = []
    size = 0
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise RequestLimitError(f"messages[{i}] must be an object with 'role' and 'content', not "
                                    f"{type(m).__name__}", param=f"messages[{i}]")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise RequestLimitError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r:.40}",
                                    param=f"messages[{i}].role")
        if "content" not in m:
            raise RequestLimitError(f"messages[{i}] has no 'content'", param=f"messages[{i}].content")
        content = m["content"]
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                ptype = part.get("type") if isinstance(part, Mapping) else None
                text = part.get("text") if isinstance(part, Mapping) else None
                if ptype != "text" or not isinstance(text, str):
                    raise RequestLimitError(f"only text content parts are supported (messages[{i}].content[{j}] "
                                            f"is {ptype!r:.40})", param=f"messages[{i}].content[{j}]")
                texts.append(text)
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise RequestLimitError(f"messages[{i}].content must be a string or a list of text parts, not "
                                    f"{type(content).__name__}", param=f"messages[{i}].content")
        size += len(content)
        msg = {"role": "system" if role == "developer" else role, "content": content}
        name = m.get("name")
        if isinstance(name, str):
            msg["name"] = name
        out.append(msg)
    cap = limits.prompt_chars(max_model_len)
    if size > cap:
        raise _over("the messages' length (characters)", size, "max_prompt_chars", limits, "messages", cap)
    return out


def messages_chars(messages: list[dict]) -> int:
    return sum(len(m["content"]) for m in messages)


# ---------------------------------------------------------------- sampling parameters


def _finite(name: str, v) -> None:
    if v is not msgspec.UNSET and not math.isfinite(v):  # UNSET: the model's default, resolved later
        raise RequestLimitError(f"{name} must be a finite number, got {v}", param=name)


def _dedupe_ids(name: str, ids, vocab_size: int, limit: str, limits: RequestLimits) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise RequestLimitError(f"{name} must be a list of token ids", param=name)
    cap = getattr(limits, limit)
    if len(ids) > 8 * cap:  # duplicates cannot excuse an absurd list: refuse before even deduping
        raise _over(f"the number of {name}", len(ids), limit, limits, name)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise RequestLimitError(f"{name} must be integers, got {type(t).__name__}", param=name)
    seen = list(dict.fromkeys(ids))
    if len(seen) > cap:
        raise _over(f"the number of distinct {name}", len(seen), limit, limits, name)
    for t in seen:
        if not 0 <= t < vocab_size:
            raise RequestLimitError(f"{name}: token id {t} is outside the vocabulary [0, {vocab_size})", param=name)
    return seen


def check_sampling_params(p: SamplingParams, limits: RequestLimits, vocab_size: int,
                          eos_token_ids=(), bad_words_token_ids: list[list[int]] | None = None
                          ) -> SamplingParams:
    """``p`` within the limits and the vocabulary; returns it with id lists deduplicated (a new
    struct only when something changed). ``bad_words_token_ids``: the tokenized bad words, to
    check that ``allowed_token_ids`` leaves something to sample."""
    if not isinstance(p, SamplingParams):
        raise InvalidRequestError(f"sampling params must be SamplingParams, not {type(p).__name__}")
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        _finite(name, getattr(p, name))
    if p.n > limits.max_n:
        raise _over("n", p.n, "max_n", limits, "n")
    if p.logprobs is not None and p.logprobs > limits.max_logprobs:
        raise _over("logprobs", p.logprobs, "max_logprobs", limits, "logprobs")
    if p.prompt_logprobs is not None and p.prompt_logprobs > limits.max_prompt_logprobs:
        raise _over("prompt_logprobs", p.prompt_logprobs, "max_prompt_logprobs", limits, "prompt_logprobs")
    changes: dict = {}
    if p.stop:
        if len(p.stop) > limits.max_stop_strings:
            raise _over("the number of stop strings", len(p.stop), "max_stop_strings", limits, "stop")
        for s in p.stop:
            if not isinstance(s, str):
                raise RequestLimitError(f"stop strings must be strings, got {type(s).__name__}", param="stop")
            if len(s) > limits.max_stop_string_chars:
                raise _over("a stop string's length (characters)", len(s), "max_stop_string_chars", limits, "stop")
    if p.bad_words:
        if len(p.bad_words) > limits.max_bad_words:
            raise _over("the number of bad_words", len(p.bad_words), "max_bad_words", limits, "bad_words")
        for w in p.bad_words:
            if not isinstance(w, str) or len(w) > limits.max_stop_string_chars:
                raise RequestLimitError(f"bad_words must be strings of at most max_stop_string_chars="
                                        f"{limits.max_stop_string_chars} characters", param="bad_words",
                                        limit="max_stop_string_chars")
    if p.stop_token_ids:
        ids = _dedupe_ids("stop_token_ids", p.stop_token_ids, vocab_size, "max_stop_token_ids", limits)
        if len(ids) != len(p.stop_token_ids):
            changes["stop_token_ids"] = ids
    if p.allowed_token_ids is not None:
        ids = _dedupe_ids("allowed_token_ids", p.allowed_token_ids, vocab_size, "max_allowed_token_ids", limits)
        if len(ids) != len(p.allowed_token_ids):
            changes["allowed_token_ids"] = ids
    if p.logit_bias:
        if not isinstance(p.logit_bias, Mapping):
            raise RequestLimitError("logit_bias must be a {token id: bias} mapping", param="logit_bias")
        if len(p.logit_bias) > limits.max_logit_bias:
            raise _over("the number of logit_bias entries", len(p.logit_bias), "max_logit_bias", limits, "logit_bias")
        for t, b in p.logit_bias.items():
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise RequestLimitError(f"logit_bias: token id {t!r:.20} is outside the vocabulary "
                                        f"[0, {vocab_size})", param="logit_bias")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
                raise RequestLimitError(f"logit_bias: the bias of token {t} must be a finite number, got {b!r:.20}",
                                        param="logit_bias")
    so = p.structured_outputs
    if so is not None and so.after is not None and not all(t < vocab_size for t in so.after):
        raise RequestLimitError(f"structured_outputs.after: token ids must be in the vocabulary [0, {vocab_size})",
                                param="structured_outputs")
    if changes:
        p = msgspec.structs.replace(p, **changes)
    check_allowed_tokens(p, eos_token_ids, bad_words_token_ids)
    return p


def check_allowed_tokens(p: SamplingParams, eos_token_ids=(), bad_words_token_ids: list[list[int]] | None = None
                         ) -> None:
    """``allowed_token_ids`` must leave a token to sample once min_tokens (which bans EOS and
    stop_token_ids) and bad_words (the last token of each, banned in some context) have banned
    theirs: otherwise the sampler would have to pick a token outside the allowed set."""
    if p.allowed_token_ids is None:
        return
    banned = {w[-1] for w in (bad_words_token_ids or ()) if w}
    if p.min_tokens > 0:
        banned |= set(eos_token_ids) | set(p.stop_token_ids or ())
    if banned and set(p.allowed_token_ids) <= banned:
        raise RequestLimitError(
            "allowed_token_ids: every allowed token may be banned (by min_tokens, which bans EOS and "
            "stop_token_ids, or by bad_words), so no allowed token could be sampled",
            param="allowed_token_ids")
