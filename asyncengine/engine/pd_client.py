"""Disaggregated prefill/decode in one front end: ``prefill_cores`` engine cores that only prefill
and ``decode_cores`` that decode, each in its own process, KV moved through shared memory.

Each request goes first to a prefill core as a one-token request: the core computes the prompt and
writes its KV to the request's transfer file (kv_connector/pd/) right after that forward. Then the
same request (same id, prompt and sampling parameters) goes to a decode core, which loads the file
instead of computing the prompt, computes the last prompt token, samples the first token itself
and streams as any engine does: the prefill core's token is not used, so sampling, penalties and
seeds behave exactly as on one core. A prompt's prefill thus never shares a step with other
users' decodes. Each side picks its least loaded core (requests in flight from this front end).

Aborts: leaving the stream early (or ``abort``) aborts the request on whichever core has it,
which frees its blocks there, and deletes its transfer file if it was written but not claimed. A
file written by a step already in flight when the abort landed is deleted by the prefill cores'
sweep once older than ``kv_transfer_lease_s``. A core that dies fails its requests with
``EngineDeadError`` (the async engine's own death detection). Built from ``AsyncLLMEngine``s with
``engine_core_process=True``, so this module adds routing only.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import tempfile
import uuid

from asyncengine.config import EngineConfig
from asyncengine.engine.async_engine import AsyncLLMEngine
from asyncengine.kv_connector.pd import transfer_file as tf
from asyncengine.sampling_params import SamplingParams


class PDEngine:
    def __init__(self, config: EngineConfig, skip_hop_below: int = 0) -> None:
        """``skip_hop_below``: prompts of fewer tokens (token ids or text; chat messages always take
        the hop) go straight to a decode core, which computes them itself: a short prompt's prefill
        stalls the decodes little, and the hop costs it a queue and a step."""
        if config.prefill_cores < 1 or config.decode_cores < 1:
            raise ValueError("PDEngine needs prefill_cores >= 1 and decode_cores >= 1")
        self.config = config
        self.skip_hop_below = skip_hop_below
        self.num_skipped_hops = 0
        base = config.kv_transfer_dir or tf.default_dir()
        os.makedirs(base, exist_ok=True)
        _remove_dead_folders(base)
        # a folder per front end (named by its pid): its cores' files, removed with it
        self.transfer_dir = tempfile.mkdtemp(prefix=f"pd-{os.getpid()}-", dir=base)

        def core(role: str) -> AsyncLLMEngine:
            return AsyncLLMEngine(dataclasses.replace(
                config, prefill_cores=0, decode_cores=0, kv_role=role, kv_transfer_dir=self.transfer_dir,
                engine_core_process=True, data_parallel_size=1))

        self.prefill = [core("prefill") for _ in range(config.prefill_cores)]
        self.decode = [core("decode") for _ in range(config.decode_cores)]
        self._load = {id(e): 0 for e in self.prefill + self.decode}
        self._closed = False

    @classmethod
    def from_config(cls, config: EngineConfig, skip_hop_below: int = 0) -> "PDEngine":
        return cls(config, skip_hop_below)

    def _num_prompt_tokens(self, prompt) -> int | None:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return len(prompt["prompt_token_ids"])
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        if isinstance(prompt, str) and self.tokenizer is not None:
            return len(self.tokenizer.encode(prompt))
        return None  # chat messages: the template is the engine's to apply

    @property
    def engines(self) -> list[AsyncLLMEngine]:
        return self.prefill + self.decode

    @property
    def tokenizer(self):
        return self.decode[0].tokenizer

    async def start(self) -> None:
        for e in self.engines:
            await e.start()

    async def __aenter__(self) -> "PDEngine":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown(drain=False)

    async def shutdown(self, drain: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*(e.shutdown(drain=drain) for e in self.engines), return_exceptions=True)
        for name in os.listdir(self.transfer_dir):
            try:
                os.unlink(os.path.join(self.transfer_dir, name))
            except OSError:
                pass
        try:
            os.rmdir(self.transfer_dir)
        except OSError:
            pass

    def _pick(self, engines: list[AsyncLLMEngine]) -> AsyncLLMEngine:
        return min(engines, key=lambda e: self._load[id(e)])

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0, cache_salt: str | None = None):
        """As ``AsyncLLMEngine.generate``: an async iterator of RequestOutputs, streamed by the
        decode core."""
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        p, d = self._pick(self.prefill), self._pick(self.decode)
        one = SamplingParams(max_tokens=1, temperature=0.0)
        kw = dict(request_id=rid, priority=priority, cache_salt=cache_salt)
        finished = False
        n = self._num_prompt_tokens(prompt) if self.skip_hop_below else None
        hop = n is None or n >= self.skip_hop_below
        self.num_skipped_hops += not hop
        try:
            self._load[id(p)] += hop
            try:
                if hop:
                    async for _ in p.generate(prompt, one, **kw):
                        pass
            finally:
                self._load[id(p)] -= hop
            self._load[id(d)] += 1
            try:
                async for out in d.generate(prompt, sampling_params, **kw):
                    finished = out.finished
                    yield out
            finally:
                self._load[id(d)] -= 1
        finally:
            if not finished:  # aborted or failed before the decode core claimed the file
                try:
                    os.unlink(tf.file_path(self.transfer_dir, rid))
                except OSError:
                    pass

    async def abort(self, request_id: str) -> None:
        for e in self.engines:
            await e.abort(request_id)
        try:
            os.unlink(tf.file_path(self.transfer_dir, request_id))
        except OSError:
            pass

    def stats(self) -> dict:
        """Per core: its engine's stats (``prefill``/``decode`` lists), and the transfer files now."""
        return {"prefill": [e.stats() for e in self.prefill], "decode": [e.stats() for e in self.decode],
                "transfer_files": len(os.listdir(self.transfer_dir)) if not self._closed else 0,
                "num_skipped_hops": self.num_skipped_hops}


def _remove_dead_folders(base: str) -> None:
    """Transfer folders of front ends that died without shutting down (their cores died with them)."""
    import shutil

    for name in os.listdir(base):
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != "pd" or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        except PermissionError:
            pass
