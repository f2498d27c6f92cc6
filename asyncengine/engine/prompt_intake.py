"""How the async engine turns what a caller gave into a prompt the core can take, without
stalling the event loop: short prompts are checked and tokenized (or chat-rendered) on the loop;
long ones, long stop-string sets and structured-output grammars are prepared on worker threads (at
most ``limits.max_concurrent_tokenizations`` at once), their errors surfacing at the stream's
first iteration.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from asyncengine.engine import validation
from asyncengine.engine.processor import InputProcessor
from asyncengine.engine.stop_strings import StopAutomaton
from asyncengine.errors import InvalidRequestError
from asyncengine.sampling_params import SamplingParams

# stop strings longer than this in all are built into their automaton on a worker thread
STOP_CHARS_OFF_LOOP = 1024


def is_chat(prompt) -> bool:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and bool(prompt) \
        and isinstance(prompt[0], Mapping)


def check_params(params) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling params must be SamplingParams, not {type(params).__name__}")
    return params


class PromptIntake:
    def __init__(self, processor: InputProcessor, limits) -> None:
        self.processor = processor
        self.limits = limits
        self.tokenizer = processor.tokenizer
        self.tokenizing: asyncio.Semaphore | None = None  # bound to the engine's loop

    def bind(self) -> None:
        """On the (new) event loop: the semaphore that bounds the worker threads tokenizing."""
        self.tokenizing = asyncio.Semaphore(self.limits.max_concurrent_tokenizations)

    def precheck(self, prompt, params: SamplingParams) -> tuple[str, object]:
        """The cheap checks, on the loop; returns (kind, payload): kind "now" (payload: the prompt
        to submit at once, chat already rendered), or for the work done later by :meth:`prepare`:
        "chat" (messages to render), "text" (to tokenize), "images" (to decode and process), "ready"
        (only the stop automaton or the grammar is long to build)."""
        proc, limits = self.processor, self.limits
        if is_chat(prompt):
            messages = validation.check_messages(prompt, limits, proc.max_model_len)
            size, payload = validation.messages_chars(messages), messages
        else:
            text = prompt.get("prompt") if isinstance(prompt, Mapping) and "prompt_token_ids" not in prompt \
                else prompt
            if isinstance(text, str) and self.tokenizer is not None:
                proc.check_text(text)
            size, payload = (len(text) if isinstance(text, str) else 0), text
            if isinstance(prompt, Mapping) and prompt.get("multi_modal_data") is not None:
                return "images", prompt  # decoded and processed on a worker thread (prepare)
        long_text = size > limits.off_loop_chars and self.tokenizer is not None
        long_stops = sum(len(x) for x in params.stop or ()) > STOP_CHARS_OFF_LOOP and self.tokenizer is not None
        if long_text or long_stops or params.structured_outputs is not None:
            if is_chat(prompt):
                return "chat", payload
            return ("text", payload) if long_text else ("ready", prompt)
        if is_chat(prompt):
            return "now", {"prompt_token_ids": proc.render_chat(payload)}
        return "now", prompt

    async def prepare(self, kind: str, payload, params: SamplingParams, still_wanted) -> tuple | None:
        """The long part, on worker threads: (prompt, stop automaton), or None if ``still_wanted()``
        turned false while it waited for a thread."""
        proc = self.processor
        async with self.tokenizing:
            if not still_wanted():
                return None
            prompt = payload
            if kind == "chat":
                prompt = {"prompt_token_ids": await asyncio.to_thread(proc.render_chat, payload)}
            elif kind == "images":  # decoding and the image processor: off the loop
                prompt = await asyncio.to_thread(proc.prepare_images, payload)
            elif kind == "text":
                _, ids = await asyncio.to_thread(proc.tokenize, payload)
                prompt = {"prompt": payload, "prompt_token_ids": ids}
            automaton = await asyncio.to_thread(StopAutomaton, params.stop) if params.stop else None
        return prompt, automaton

    async def encode(self, prompt) -> tuple[str | None, list[int]]:
        """Check and tokenize a prompt the way generate() will: ``(text or None, token ids)``."""
        proc = self.processor
        if is_chat(prompt):
            messages = validation.check_messages(prompt, self.limits, proc.max_model_len)
            if validation.messages_chars(messages) > self.limits.off_loop_chars:
                async with self.tokenizing:
                    return None, await asyncio.to_thread(proc.render_chat, messages)
            return None, proc.render_chat(messages)
        if isinstance(prompt, str) and self.tokenizer is not None:
            proc.check_text(prompt)
            if len(prompt) > self.limits.off_loop_chars:
                async with self.tokenizing:
                    return await asyncio.to_thread(proc.tokenize, prompt)
        return proc.tokenize(prompt)
