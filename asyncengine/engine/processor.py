"""Input processing: prompts and parameters in, validated core ``Request``s out.

Everything that can be wrong with a request is caught here, before it reaches the scheduler, with
an ``InvalidRequestError`` naming the problem; the engine itself never sees a bad request. The
rules and limits themselves live in ``validation.py`` (shared with the HTTP server).
"""
from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from asyncengine.core.request import Request
from asyncengine.engine import validation
from asyncengine.engine.validation import RequestLimits
from asyncengine.config.lora import (adapter_fingerprint, check_adapter_files, check_adapter_shapes,
                                     check_adapter_values, model_shapes)
from asyncengine.errors import ConfigError, InvalidRequestError
from asyncengine.models.sampling_defaults import model_defaults, resolve
from asyncengine.sampling_params import SamplingParams

PromptType = str | Sequence[int] | Mapping


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids,
                 limits: RequestLimits | None = None, generation_config: dict | None = None, mm=None) -> None:
        self.tokenizer = tokenizer
        self.mm = mm  # a vision-language model's MultiModalProcessor (multimodal/processor.py), else None
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.limits = limits or RequestLimits()
        # the fields a caller leaves unset: the model's generation config, then the engine's table
        self.sampling_defaults = model_defaults(generation_config)

    def resolve(self, params: SamplingParams | None) -> SamplingParams:
        """The one place unset sampling fields get their values (models/sampling_defaults.py), for
        every front end: ``LLM`` and ``AsyncLLMEngine`` (and so the CLI, the server, the adapters)."""
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, not {type(params).__name__}")
        return resolve(params, self.sampling_defaults)

    def check_text(self, text: str, param: str = "prompt") -> None:
        """A text prompt's length in characters, before it is tokenized."""
        validation.check_prompt_chars(text, self.limits, self.max_model_len, param)

    def encode(self, text: str, **kw) -> list[int]:
        """The tokenizer's ids for ``text``; a tokenizer that refuses it fails this request only."""
        try:
            return list(self.tokenizer.encode(text, **kw))
        except Exception as e:
            raise InvalidRequestError(f"the tokenizer cannot encode this prompt: {type(e).__name__}: {e}") from None

    def render_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        """Chat messages (validated: roles, contents, total length) through the chat template."""
        msgs = validation.check_messages(messages, self.limits, self.max_model_len)
        if self.tokenizer is None:
            raise InvalidRequestError("chat messages need a tokenizer")
        return render_chat_checked(self.tokenizer, msgs, add_generation_prompt)

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
            self.check_text(prompt)
            return prompt, self.encode(prompt)
        if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
            return None, self._check_ids(prompt)
        raise InvalidRequestError(f"a prompt must be a string, a list of token ids or a dict, "
                                  f"not {type(prompt).__name__}")

    def _multimodal(self):
        if self.mm is None:
            raise InvalidRequestError("this model takes no images (multi_modal_data)")
        return self.mm

    def prepare_images(self, prompt: Mapping) -> dict:
        """A prompt with ``multi_modal_data`` as a prompt whose images are processed (``mm_inputs``)
        and placeholders expanded: the slow part (decoding, resizing), for a worker thread."""
        text, ids = self.tokenize(prompt)
        ids, inputs = self._multimodal().process(ids, prompt["multi_modal_data"])
        return {"prompt_token_ids": ids, "mm_inputs": inputs, **({"prompt": text} if text is not None else {})}

    def _check_ids(self, ids) -> list[int]:
        if isinstance(ids, (str, bytes, bytearray, Mapping)) or not isinstance(ids, Sequence):
            raise InvalidRequestError(f"prompt_token_ids must be a list of integers, not {type(ids).__name__}")
        if len(ids) >= self.max_model_len:  # before looking at each of them
            raise InvalidRequestError(
                f"the prompt is {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                f"it must be shorter to leave room for at least one output token")
        return validation.check_token_ids(ids, self.vocab_size)

    def make_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None,
                     priority: int = 0, cache_salt: str | None = None,
                     arrival_time: float | None = None, lora_request=None) -> tuple[Request, str | None]:
        params = self.resolve(params)  # a no-op when the async front end resolved them already
        # the cheap checks first: a request over a limit costs no tokenization
        params = validation.check_sampling_params(params, self.limits, self.vocab_size, self.eos_token_ids)
        text, ids = self.tokenize(prompt)
        mm_inputs = None
        if isinstance(prompt, Mapping) and prompt.get("mm_inputs") is not None:  # prepare_images made them
            mm_inputs = self._multimodal().check_prepared(ids, prompt["mm_inputs"])
        elif isinstance(prompt, Mapping) and prompt.get("multi_modal_data") is not None:
            ids, mm_inputs = self._multimodal().process(ids, prompt["multi_modal_data"])  # placeholders expanded
        if not ids:
            raise InvalidRequestError("the prompt is empty (no tokens)")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt is {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                f"it must be shorter to leave room for at least one output token")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        bad_words = None
        if params.bad_words:
            if self.tokenizer is None:
                raise InvalidRequestError("bad_words needs a tokenizer")
            bad_words = []
            for w in params.bad_words:
                for variant in (w, " " + w.lstrip()):
                    toks = self.encode(variant, add_special_tokens=False)
                    if toks and toks not in bad_words:
                        bad_words.append(toks)
            validation.check_allowed_tokens(params, self.eos_token_ids, bad_words)
        req = Request(request_id=request_id, prompt_token_ids=ids, sampling_params=params,
                      eos_token_ids=self.eos_token_ids, max_tokens=max_tokens, priority=priority,
                      cache_salt=lora_salt(cache_salt, lora_request), bad_words_token_ids=bad_words,
                      lora_request=lora_request, mm_inputs=mm_inputs or None,
                      arrival_time=arrival_time if arrival_time is not None else time.monotonic())
        return req, text


# fingerprints (path, size, mtime) of adapter files whose every tensor was read and found whole and
# finite: a version is scanned once per process, later requests only stat the file
_VALUES_CHECKED: OrderedDict[str, None] = OrderedDict()
_VALUES_CHECKED_MAX = 256


def check_lora_request(lora_request, config, hf_config=None, ids: dict[int, str] | None = None) -> None:
    """A LoRARequest needs enable_lora, and its adapter's files, options, rank, shapes and values
    must pass (config/lora.py) before the request reaches a worker: a bad adapter is a 400, not a
    failed step. ``ids``: the engine's adapter id -> folder map, so that one id never names two
    adapters (the worker keys its loaded adapters by id: a second folder under the same id would
    silently run the first one's weights)."""
    if lora_request is None:
        return
    if not config.enable_lora:
        raise InvalidRequestError("a LoRA adapter was asked for, but the engine runs without enable_lora")
    try:
        cfg = check_adapter_files(lora_request.path, config.max_lora_rank)
        if hf_config is not None and hasattr(hf_config, "intermediate_size"):
            check_adapter_shapes(lora_request.path, cfg["r"], model_shapes(hf_config))
        fingerprint = adapter_fingerprint(lora_request.path)
        if fingerprint not in _VALUES_CHECKED:
            check_adapter_values(lora_request.path)
            _VALUES_CHECKED[fingerprint] = None
            if len(_VALUES_CHECKED) > _VALUES_CHECKED_MAX:
                _VALUES_CHECKED.popitem(last=False)
    except ConfigError as e:
        raise InvalidRequestError(str(e)) from None
    if ids is not None:
        folder = os.path.realpath(lora_request.path)
        if ids.setdefault(lora_request.id, folder) != folder:
            raise InvalidRequestError(f"LoRA id {lora_request.id} already names the adapter at {ids[lora_request.id]!r}; "
                                      f"give the adapter at {folder!r} an id of its own")


def lora_salt(cache_salt: str | None, lora_request) -> str | None:
    """The prefix cache keys blocks by salt: an adapter's id and its weights' fingerprint join it,
    so the same prompt under two adapters (or an adapter and the base model) shares no KV block,
    here, offloaded (across restarts too) or in P/D."""
    if lora_request is None:
        return cache_salt
    return f"{cache_salt or ''}\x00lora:{lora_request.id}:{adapter_fingerprint(lora_request.path)}"


def render_chat_checked(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Already-validated messages through the tokenizer's chat template; a template that refuses
    them (a jinja error, a raise_exception in the template) is this request's error."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("the tokenizer has no chat template")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    except Exception as e:
        raise InvalidRequestError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") \
            from None
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
